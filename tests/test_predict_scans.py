"""moe.predict_scans: decode's layer loop cut into scans so that the next layer's router and the
expert fetch run only before host-tier layers. Pure: checked against brute force over every way
to cut the periods, and against what the device does with each fetch (prefetch.h expert_count)."""

from __future__ import annotations

import itertools

from hypothesis import given, settings, strategies as st

from jaxvt.model import moe


def _cuts(n: int, k: int):
  """Every way to cut periods [0, n) into at most k consecutive nonempty scans."""
  for s in range(1, min(k, n) + 1):
    for inner in itertools.combinations(range(1, n), s - 1):
      yield (0, *inner, n)


def _needs(hosts, n_layers: int, li: int) -> bool:
  return li + 1 < n_layers and any(li + 1 in h for h in hosts)


def _cost(hosts, n_layers, period, cuts) -> int:
  total = 0
  for a, b in zip(cuts, cuts[1:]):
    used = sum(any(_needs(hosts, n_layers, p * period + j) for p in range(a, b))
               for j in range(period))
    total += (b - a) * used
  return total


def _served(fetch: str, li_host: bool) -> bool:
  """Whether a layer's fetches of kind `fetch` copy a stack's experts of layer li + 1 (a
  host-tier layer of that stack) when layer li is (li_host) or is not host-tier there: the
  "after_device" fetch copies only after a device-tier layer, "after_host" only after a
  host-tier one (prefetch.h expert_count's `when`)."""
  return fetch == "both" or fetch == ("after_host" if li_host else "after_device")


layouts = st.integers(1, 4).flatmap(lambda period: st.tuples(
    st.just(period), st.integers(1, 6).map(lambda n: n * period)).flatmap(
        lambda pn: st.tuples(st.just(pn[0]), st.just(pn[1]),
                             st.lists(st.frozensets(st.integers(0, pn[1] - 1)), min_size=1,
                                      max_size=3),
                             st.integers(0, 7))))


@settings(max_examples=300, deadline=None)
@given(layouts)
def test_scans_fetch_where_needed_and_fewest(layout):
  period, n_layers, hosts, k = layout
  scans = moe.predict_scans(hosts, n_layers, period, k)
  n = n_layers // period
  # consecutive scans covering every period, at most k (0: no limit)
  cuts = (scans[0][0], *(b for _, b, _ in scans))
  assert cuts[0] == 0 and cuts[-1] == n and all(a < b for a, b in zip(cuts, cuts[1:]))
  assert all(scans[i][1] == scans[i + 1][0] for i in range(len(scans) - 1))
  assert k == 0 or len(scans) <= k
  for a, b, fetches in scans:
    assert len(fetches) == period
    for p in range(a, b):
      for j, fetch in enumerate(fetches):
        li = p * period + j
        if fetch == "":  # nothing fetched: no period of the scan needs it there
          assert not _needs(hosts, n_layers, li)
        for h in hosts:  # every stack's host-tier layer li + 1 is served by the fetch's kind
          if li + 1 < n_layers and li + 1 in h:
            assert _served(fetch, li in h), (li, fetch, hosts)
      # a position fetching that no period needs fetches nothing
    for j, fetch in enumerate(fetches):
      if fetch:
        assert any(_needs(hosts, n_layers, p * period + j) for p in range(a, b))
  # the fewest fetching layers plus a period for each scan after the first, of any cut into at
  # most k scans, then the fewest scans
  limit = n if k == 0 else k
  score = lambda c: (_cost(hosts, n_layers, period, c) + period * (len(c) - 2), len(c) - 1)
  assert score(cuts) == min(score(c) for c in _cuts(n, limit))


def test_auto_on_the_35b_shape():
  """The 35B-shaped file at auto (host-tier layers 3, 7, 12, 16, 21, 25, 30, 34, 39 of 40, a
  period of 4): one scan fetches in every layer (as before the cut); three scans in 17 layers
  (17 + 2 x 4 = 25, as four scans' 13 + 3 x 4: the fewer scans), cut at periods 4 and 7."""
  host = frozenset({3, 7, 12, 16, 21, 25, 30, 34, 39})
  fetching = lambda scans: sum((b - a) * sum(map(bool, f)) for a, b, f in scans)
  one = moe.predict_scans([host] * 3, 40, 4, 1)
  assert one == ((0, 10, ("after_device",) * 4),) and fetching(one) == 40
  cut = moe.predict_scans([host] * 3, 40, 4, 0)
  assert cut == ((0, 4, ("", "", "after_device", "after_device")),
                 (4, 7, ("after_device", "", "", "")),
                 (7, 10, ("", "after_device", "after_device", "")))
  assert fetching(cut) == 17 and moe.predict_scans([host], 40, 4, 3) == cut
  assert fetching(moe.predict_scans([host], 40, 4, 2)) == 25


def test_every_layer_host_tier():
  """Every layer host-tier: one scan, every fetch after a host-tier layer (a second scan would
  spare only the last layer's fetch, which is less than its period)."""
  every = frozenset(range(8))
  assert moe.predict_scans([every], 8, 4, 0) == ((0, 2, ("after_host",) * 4),)
