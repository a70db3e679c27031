"""The rule for files the agent re-reads while it serves (runtime/inputs.py): a failing read keeps
what is in use, is counted once per failing content, and is said until a read is taken."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from pdfabric_agent.process.rankmap_file import RankMapFile
from pdfabric_agent.runtime import metrics
from pdfabric_agent.runtime.inputs import MAX_FILE_BYTES, RereadFile, refused_inputs
from tests.unit.rankmaps import MALFORMED, a_rankmap


def refusals(cluster: str, name: str) -> float:
    value = metrics.REGISTRY.get_sample_value("pdfabric_input_refusals_total", {"pdcluster": cluster, "input": name})
    return value or 0.0


def write(path: Path, text: str) -> None:
    """As the kubelet does: the new content appears at once (a rename over the old name)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def test_a_parser_that_raises_anything_is_a_refusal_not_an_exit(tmp_path: Path) -> None:
    path = tmp_path / "f.json"
    write(path, "1")

    def parse(text: str) -> int:
        if text == "recurse":
            raise RecursionError("maximum recursion depth exceeded")
        if text == "attr":
            raise AttributeError("'list' object has no attribute 'get'")
        return int(text)

    f = RereadFile("thing", str(path), parse, "c-any")
    assert f.read_first() == 1
    for bad in ("recurse", "attr", "x"):
        write(path, bad)
        assert f.check() is None
        assert f.problem.startswith(f"{path} (sha256 ") and "does not parse" in f.problem
    assert refusals("c-any", "thing") == 3
    write(path, "2")
    assert f.check() == 2 and f.problem == ""


def test_a_bad_content_is_counted_once_and_said_until_a_good_one_comes(tmp_path: Path) -> None:
    path = tmp_path / "rankmap.json"
    rm = a_rankmap()
    write(path, rm.to_json())
    source = RankMapFile(str(path))
    assert source.rankmap == rm and refusals(rm.cluster, "rankmap") == 0
    write(path, "[1, 2]")
    for _ in range(3):  # read every second: the same content is one refusal
        assert source.newer() is None
    assert refusals(rm.cluster, "rankmap") == 1
    assert "must be a JSON object, not list" in source.problem
    assert refused_inputs([source]) == {"rankmap": source.problem}
    assert source.rankmap == rm, "the map in use stays"

    path.unlink()  # unreadable for a while: said, counted, the map stays
    assert source.newer() is None and "unreadable" in source.problem
    write(path, "[1, 2]")  # back with the same bad content: that is what is said again
    assert source.newer() is None and "must be a JSON object" in source.problem

    newer = json.loads(rm.to_json()) | {"transport": "rdma"}
    write(path, json.dumps(newer))
    taken = source.newer()
    assert taken is not None and taken.transport == "rdma" and source.rankmap is taken
    assert source.problem == "" and refused_inputs([source]) == {}


def test_an_unreadable_file_that_comes_back_unchanged_is_taken_again(tmp_path: Path) -> None:
    path = tmp_path / "rankmap.json"
    write(path, a_rankmap().to_json())
    source = RankMapFile(str(path))
    text = path.read_text()
    path.unlink()
    assert source.newer() is None and source.problem
    write(path, text)
    assert source.newer() is None and source.problem == ""


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_each_malformed_rankmap_keeps_the_map_in_use(tmp_path: Path, name: str) -> None:
    path = tmp_path / "rankmap.json"
    write(path, a_rankmap().to_json())
    source = RankMapFile(str(path))
    write(path, MALFORMED[name][0])
    assert source.newer() is None and source.rankmap == a_rankmap()
    assert MALFORMED[name][1] in source.problem or "does not parse" in source.problem


def test_a_file_past_the_size_bound_or_not_utf8_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "rankmap.json"
    write(path, a_rankmap().to_json())
    source = RankMapFile(str(path))
    path.write_bytes(b" " * (MAX_FILE_BYTES + 1))
    assert source.newer() is None and f"larger than {MAX_FILE_BYTES} bytes" in source.problem
    path.write_bytes(b'{"a": "\xff"}')
    assert source.newer() is None and "utf-8" in source.problem
