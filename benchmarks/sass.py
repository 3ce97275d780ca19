"""Reading nvdisasm's SASS listing: what the compile report asks of it beyond access widths.

No side effects on import (benchmarks/compile_report.py switches Triton's interpreter off
when imported): tests import this module in their own process.
"""
import re

__all__ = ["barriers", "loop_barriers"]

_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(.*)")
_BRANCH = re.compile(r"\bBRA\b.*`\((\.L_x_\d+)\)")


def barriers(sass):
    """The ``BAR.SYNC`` instructions of ``sass`` (nvdisasm's listing), wherever they are:
    in a kernel that reduces across a row held by several warps, each reduction but the
    first waits on one to reuse the exchange buffer and one for its partial sums."""
    return sum("BAR.SYNC" in m.group(1) for m in map(_INSTRUCTION.search, sass.splitlines())
               if m)


def loop_barriers(sass):
    """(loops, barriers in them): the backward branches of ``sass`` (nvdisasm's listing)
    that close a body of more than one instruction, and the ``BAR.SYNC`` instructions
    between each such branch and its target. A reduction across a tile's threads inside
    a loop shows up as barriers there; running accumulators reduced after the loop do
    not."""
    labels, body = {}, []
    for line in sass.splitlines():
        m = _LABEL.match(line)
        if m:
            labels[m.group(1)] = len(body)
            continue
        m = _INSTRUCTION.search(line)
        if m:
            body.append(m.group(1))
    loops = barriers = 0
    for i, ins in enumerate(body):
        m = _BRANCH.search(ins)
        start = labels.get(m.group(1)) if m else None
        if start is not None and start < i:
            loops += 1
            barriers += sum("BAR.SYNC" in b for b in body[start:i + 1])
    return loops, barriers
