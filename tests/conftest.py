"""Session setup.

Caches: jaxvt's caches live in directories of this test session (shared by the tests and the
CLI processes they start, removed at the end), not in the user's ~/.cache/jaxvt, so that every
run of the suite starts from nothing, as on a fresh machine: JAX's persistent compilation cache
(a JAXVT_COMPILE_CACHE set by the caller is left as it is) and, through XDG_CACHE_HOME, the
host-link rates `python -m jaxvt.offload.probe` caches, which `--plan` would otherwise print
from the user's last probe.

Slow tests: the end-to-end cases in SLOW are marked `slow` here, in one list (beside the tests
marked in their own files), so that the default `python -m pytest -q` (pyproject's addopts:
-m 'not gpu and not slow') stays short on a 2-core laptop while every test module keeps tests
in it; `.ci/run` runs the slow ones after it (`-m 'slow and not gpu'`). Each is a larger or
repeated version of a check the module also makes by default: several processes, a second
architecture, a sweep, a bigger model, another numerics mode of a format. An entry without
[...] covers every parametrization; an entry naming a test that no longer exists stops the
run, so a rename cannot quietly make a slow test part of the default run.
"""

import os
import shutil
import tempfile

import pytest

SLOW = (
    "tests/test_invariance.py::test_generate_and_server_give_the_same_tokens[hybrid]",
    "tests/test_invariance.py::test_eight_concurrent_requests_equal_their_solo_answers",
    "tests/test_invariance.py::test_next_turn_from_the_prefix_cache_equals_a_cold_run",
    "tests/test_invariance.py::test_a_context_that_is_no_multiple_of_8_keeps_one_recipe",
    "tests/test_attn_step.py::test_fused_decode_in_the_model[qwen35moe]",
    "tests/test_bench_mesh.py::test_every_point_in_the_table_with_positive_rates",
    "tests/test_bench_mesh.py::test_tp2_greedy_tokens_are_the_one_device_tokens",
    "tests/test_bench_offload.py::test_failed_point_frees_its_weights",
    "tests/test_bench_offload.py::test_sweep_child_end_to_end",
    "tests/test_compile_cache.py::test_second_run_loads_its_programs_from_the_cache",
    "tests/test_compile_cache.py::test_warm_up_leaves_nothing_to_compile_in_generate",
    "tests/test_determinism.py::test_processes_and_budgets_agree",
    "tests/test_exports.py::test_an_offloaded_model_gives_the_same_bits_through_the_store",
    "tests/test_ffi.py::test_kernels_equal_references_on_device[ggml]",
    "tests/test_ffi.py::test_experts_routing[ggml-x[T]-Q4_K]",
    "tests/test_ffi.py::test_experts_routing[ggml-x[T,k]-Q4_K]",
    "tests/test_ffi.py::test_experts_routing[ggml-x[T]-Q5_K]",
    "tests/test_ffi.py::test_experts_routing[ggml-x[T,k]-Q5_K]",
    "tests/test_ffi.py::test_experts_routing[ggml-x[T]-Q6_K]",
    "tests/test_ffi.py::test_experts_routing[ggml-x[T,k]-Q6_K]",
    "tests/test_ffi.py::test_experts_routing[ggml-x[T]-Q8_0]",
    "tests/test_ffi.py::test_experts_routing[ggml-x[T,k]-Q8_0]",
    "tests/test_ffi.py::test_references_match_numpy[ggml-Q4_K]",
    "tests/test_ffi.py::test_references_match_numpy[ggml-Q4_0]",
    "tests/test_ffi.py::test_references_match_numpy[ggml-Q5_K]",
    "tests/test_ffi.py::test_references_match_numpy[ggml-Q6_K]",
    "tests/test_gdn_step.py::test_fused_decode_in_the_model",
    "tests/test_hostile_api.py::test_load_close_cycles_do_not_grow",
    "tests/test_llamacpp_match.py::test_kernel_path_greedy_is_llamacpps",
    "tests/test_llamacpp_match.py::test_default_kernel_path_greedy_is_llamacpps_up_to_near_ties",
    "tests/test_llamacpp_match.py::test_reference_path_matches_llamacpp_to_rounding",
    "tests/test_load_pipeline.py::test_programs_compiled_while_loading_are_the_ones_generate_runs"
    "[0.02]",
    "tests/test_load_pipeline.py::test_the_backend_starts_beside_the_plan_and_is_waited_for[None]",
    "tests/test_moe.py::test_expert_paths_agree",
    "tests/test_moe_route.py::test_model_with_fused_route",
    "tests/test_offload_e2e.py::test_cli_unsafe_budget_refused_then_forced",
    "tests/test_parallel.py::test_offload_budget_is_per_device",
    "tests/test_parallel.py::test_sharded_equals_unsharded",
    "tests/test_prefill.py::test_gpu_rules_in_the_model_on_cpu_kernels",
    "tests/test_processes.py::test_a_process_gone_stops_the_other_with_one_line",
    "tests/test_processes.py::test_another_model_file_in_one_process_is_one_line_in_each",
    "tests/test_processes.py::test_api_over_two_processes_is_one_process",
    "tests/test_processes.py::test_cli_meshes_over_two_processes",
    "tests/test_processes.py::test_mesh_larger_than_the_devices_is_one_line_in_each",
    "tests/test_processes.py::test_mismatched_num_processes_is_one_line_in_each",
    "tests/test_processes.py::test_other_flags_in_one_process_are_one_line_in_each",
    "tests/test_qwen_offload.py::test_greedy_identical_with_experts_in_host_tier[qwen35moe]",
    "tests/test_qwen_offload.py::test_jax_pinned_host_arm_same_tokens[qwen35moe]",
    "tests/test_qwen_transformers.py::test_decoder_matches_transformers_recording[qwen35moe-ref]",
    "tests/test_qwen_transformers.py::test_decoder_matches_transformers_recording"
    "[qwen35moe_k-ref]",
    "tests/test_serve_http.py::test_client_disconnect_mid_stream_cancels_its_request",
    "tests/test_serve_http.py::test_full_queue_gets_429_and_sigterm_drains_in_flight",
    "tests/test_serve_http.py::test_hybrid_second_turn_reuses_the_first",
    "tests/test_serve_http.py::test_stop_strings_cut_streamed_and_not",
    "tests/test_serve_mesh.py::test_one_process_two_devices",
    "tests/test_serve_mesh.py::test_two_processes",
)


def pytest_configure(config):
  if "JAXVT_COMPILE_CACHE" not in os.environ:
    path = tempfile.mkdtemp(prefix="jaxvt-test-cache-")
    os.environ["JAXVT_COMPILE_CACHE"] = path
    config.add_cleanup(lambda: shutil.rmtree(path, ignore_errors=True))
  xdg = tempfile.mkdtemp(prefix="jaxvt-test-xdg-cache-")
  os.environ["XDG_CACHE_HOME"] = xdg
  config.add_cleanup(lambda: shutil.rmtree(xdg, ignore_errors=True))


def _node(item) -> str:
  """The item's id relative to the repository ("tests/test_x.py::test_y[...]")."""
  path, _, rest = item.nodeid.partition("::")
  return "tests/" + os.path.basename(path) + "::" + rest


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
  modules = {}
  for item in items:
    node = _node(item)
    modules.setdefault(node.partition("::")[0], item.module)
    if any(node == s or node.startswith(s + "[") for s in SLOW):
      item.add_marker(pytest.mark.slow)
  for entry in SLOW:
    path, _, name = entry.partition("::")
    module = modules.get(path)
    if module is not None and not hasattr(module, name.partition("[")[0]):
      raise pytest.UsageError(f"tests/conftest.py SLOW names {entry}, which {path} no longer "
                              "defines; update the list")
