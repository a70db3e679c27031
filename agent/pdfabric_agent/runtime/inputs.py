"""The files the agent reads again while it serves, under one rule.

The rank map (the operator's ConfigMap), the peer certificate (its Secret) and the peers file are
written by others while the agent runs, and a write can be half done, of another shape, or hostile.
The rule for every such input: a read that fails in any way (unreadable, not parsing, an
exception nobody foresaw) keeps what the agent runs on, is counted once per failing content
(``pdfabric_input_refusals_total{input}``), and is said on ``/readyz`` under
``inputsRefused`` until a read of that input succeeds again. Nothing a file holds may end the agent.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterable
from typing import Generic, Protocol, TypeVar

from pdfabric_agent.runtime import metrics

log = logging.getLogger("pdfabric.inputs")

T = TypeVar("T")

MAX_FILE_BYTES = 4 * 1024 * 1024  # a ConfigMap or Secret holds at most 1 MiB


class RereadInput(Protocol):
    """An input the agent re-reads: its name on /readyz and the metric, and why its last read was
    refused ("" while the last read was taken)."""

    @property
    def input_name(self) -> str: ...

    @property
    def problem(self) -> str: ...


def refused_inputs(inputs: Iterable[RereadInput]) -> dict[str, str]:
    """What /readyz says under ``inputsRefused``: each input whose last read was refused, and why."""
    return {i.input_name: i.problem for i in inputs if i.problem}


class InputRefusals:
    """The bookkeeping half of the rule, for an input that reads itself (the certificate set):
    ``refuse`` once per failing content, ``taken`` when a read succeeds."""

    def __init__(self, input_name: str, cluster: str = "") -> None:
        self.input_name = input_name
        self.problem = ""
        self._cluster = ""
        self.cluster = cluster

    @property
    def cluster(self) -> str:
        return self._cluster

    @cluster.setter
    def cluster(self, cluster: str) -> None:
        """The PDCluster label (the rank map, read first, says it)."""
        self._cluster = cluster
        if cluster:
            metrics.input_refusals.labels(cluster, self.input_name)  # at 0 from the start

    def refuse(self, problem: str) -> None:
        if problem != self.problem:
            metrics.input_refusals.labels(self.cluster, self.input_name).inc()
            log.warning("%s refused (what the agent runs on stays): %s", self.input_name, problem)
        self.problem = problem

    def taken(self) -> None:
        if self.problem:
            log.info("%s read again and taken", self.input_name)
        self.problem = ""

    def said(self, problem: str) -> None:
        """What the last read found: ``problem`` refused, or "" taken."""
        if problem:
            self.refuse(problem)
        else:
            self.taken()


class RereadFile(Generic[T]):
    """A file read again on ``check()``: the parsed value when its content changed and parses,
    None otherwise (unchanged, unreadable, or not parsing: then refused, under the rule)."""

    def __init__(self, input_name: str, path: str, parse: Callable[[str], T], cluster: str = "") -> None:
        self.path = path
        self.parse = parse
        self.refusals = InputRefusals(input_name, cluster)
        self._seen = ""  # digest of the content last read, parsed or not
        self._parse_problem = ""  # why that content did not parse, "" when it did

    @property
    def input_name(self) -> str:
        return self.refusals.input_name

    @property
    def problem(self) -> str:
        return self.refusals.problem

    def read_first(self) -> T:
        """The first read, at start: no value to keep yet, so a failure is the caller's to raise."""
        text = self._text()
        self._seen = _digest(text)
        return self.parse(text)

    def check(self) -> T | None:
        try:
            text = self._text()
        except Exception as exc:
            self.refusals.refuse(f"{self.path} unreadable: {_said(exc)}")
            return None
        seen = _digest(text)
        if seen == self._seen:  # unchanged: back to what that content was (a read error has passed)
            self.refusals.said(self._parse_problem)
            return None
        self._seen = seen
        try:
            value = self.parse(text)
        except Exception as exc:
            self._parse_problem = f"{self.path} (sha256 {seen[:12]}) does not parse: {_said(exc)}"
            self.refusals.refuse(self._parse_problem)
            return None
        self._parse_problem = ""
        self.refusals.taken()
        return value

    def _text(self) -> str:
        with open(self.path, "rb") as fh:
            data = fh.read(MAX_FILE_BYTES + 1)
        if len(data) > MAX_FILE_BYTES:
            raise ValueError(f"larger than {MAX_FILE_BYTES} bytes")
        return data.decode("utf-8")


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _said(exc: BaseException) -> str:
    """An exception in one line of bounded length (a parser may quote the input back)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."
