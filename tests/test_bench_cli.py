"""The benchmarks package: `python -m benchmarks` lists one module per benchmark, each runnable as
`python -m benchmarks.<name>`; docs/BENCHMARKS.md holds marked sections, each with its command,
machine and date, under the header benchmarks.report writes."""

from __future__ import annotations

import argparse
import importlib
import os
import re
import subprocess
import sys

import pytest

from benchmarks import __main__ as listing
from benchmarks import cli, report
from jaxvt.errors import JaxvtError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _modules() -> set[str]:
  return {f[:-3] for f in os.listdir(os.path.join(ROOT, "benchmarks"))
          if f.endswith(".py") and not f.startswith("_")}


def test_every_listed_benchmark_is_a_module_with_an_entry():
  assert set(listing.BENCHMARKS) <= _modules()
  for name in listing.BENCHMARKS:
    m = importlib.import_module(f"benchmarks.{name}")
    assert callable(m.cli) and m.parser().prog == f"python -m benchmarks.{name}", name


def test_every_module_with_an_entry_is_listed():
  with_entry = {n for n in _modules()
                if "\ndef cli(" in open(os.path.join(ROOT, "benchmarks", f"{n}.py")).read()}
  assert with_entry == set(listing.BENCHMARKS)


def test_python_m_benchmarks_lists_them_from_another_directory(tmp_path):
  p = subprocess.run([sys.executable, "-m", "benchmarks"], capture_output=True, text=True,
                     cwd=tmp_path, env=cli.child_env(), timeout=120)
  assert p.returncode == 0, p.stderr
  for name in listing.BENCHMARKS:
    assert re.search(rf"^  {name} ", p.stdout, re.M), (name, p.stdout)
  p = subprocess.run([sys.executable, "-m", "benchmarks", "nosuch"], capture_output=True,
                     text=True, cwd=tmp_path, env=cli.child_env(), timeout=120)
  assert p.returncode == 2 and "nosuch" in p.stderr


def test_child_env_puts_the_repository_first(monkeypatch):
  monkeypatch.setenv("PYTHONPATH", "/elsewhere")
  env = cli.child_env({"X": "1"})
  assert env["PYTHONPATH"].split(os.pathsep) == [ROOT, "/elsewhere"] and env["X"] == "1"
  monkeypatch.delenv("PYTHONPATH")
  assert cli.child_env()["PYTHONPATH"] == ROOT


def test_a_benchmark_reports_a_users_error_as_one_line(capsys):
  def main(args):
    raise JaxvtError("no such file: x.gguf; pass --model")
  assert cli.run(main, argparse.ArgumentParser(), []) == 2
  assert capsys.readouterr().err == "jaxvt: error: no such file: x.gguf; pass --model\n"
  assert cli.run(lambda args: "the table", argparse.ArgumentParser(), []) == 0
  assert capsys.readouterr().out == "the table\n"


def test_write_section_replaces_only_its_own(tmp_path):
  path = str(tmp_path / "B.md")
  text = report.write_section("a", "## A\n\nfirst-body", path)
  assert text.startswith(report.HEADER)
  assert "<!-- bench:a -->\n## A\n\nfirst-body\n<!-- /bench:a -->" in text
  report.write_section("b", "## B", path)
  text = report.write_section("a", "## A\n\nsecond-body", path)
  assert "second-body" in text and "first-body" not in text
  assert text.index("bench:a") < text.index("bench:b")


def _sections(text: str) -> dict[str, str]:
  return {m.group(1): m.group(2) for m in
          re.finditer(r"<!-- bench:([\w-]+) -->\n(.*?)<!-- /bench:\1 -->", text, re.S)}


def test_the_documents_sections_name_command_machine_and_date():
  text = open(os.path.join(ROOT, "docs", "BENCHMARKS.md"), encoding="utf-8").read()
  assert text.startswith(report.HEADER) and "python -m benchmarks.<name>" in report.HEADER
  secs = _sections(text)
  assert "offload" in secs and "tier-gpu" in secs
  for name, body in secs.items():
    if name == "defaults":  # constants' sources: no run of its own
      continue
    assert "Command: `" in body and "Machine: " in body and "Date: 20" in body, name
    assert "jaxvt.bench" not in body and "tools/h200" not in body, name


@pytest.mark.parametrize("name", sorted(listing.BENCHMARKS))
def test_help_of_each(name, capsys):
  m = importlib.import_module(f"benchmarks.{name}")
  with pytest.raises(SystemExit) as e:
    m.cli(["--help"])
  assert e.value.code == 0 and f"python -m benchmarks.{name}" in capsys.readouterr().out
