"""What the benchmarks that write a page share: replacing its measured block between the block's markers."""

from __future__ import annotations


def replace_block(text: str, name: str, block: str) -> str:
    """``text`` with what lies between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->`` replaced by ``block`` (the
    markers kept); ``ValueError`` if the page has no such block."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    if begin not in text or end not in text:
        raise ValueError(f"the page has no {begin} ... {end} block to replace")
    return text[:text.index(begin)] + "\n".join([begin, block, end]) + text[text.index(end) + len(end):]
