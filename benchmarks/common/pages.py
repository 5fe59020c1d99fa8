"""What the studies that write a page share: its template beside the study (``template``), its data beside it
(``save_data``) and replacing its measured block between the block's markers (``replace_block``)."""

from __future__ import annotations

import json
from pathlib import Path


def replace_block(text: str, name: str, block: str) -> str:
    """``text`` with what lies between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->`` replaced by ``block`` (the
    markers kept); ``ValueError`` if the page has no such block."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    if begin not in text or end not in text:
        raise ValueError(f"the page has no {begin} ... {end} block to replace")
    return text[:text.index(begin)] + "\n".join([begin, block, end]) + text[text.index(end) + len(end):]


def save_data(result: dict, page: Path, plot) -> tuple[Path, str]:
    """Write ``result`` as ``docs/data/<stem>.json`` beside ``page`` and ``plot(result, <stem>.png there)``;
    returns (the data folder, the page's lower-case stem)."""
    data = Path(page).parent / "data"
    data.mkdir(parents=True, exist_ok=True)
    stem = Path(page).stem.lower()
    (data / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, data / f"{stem}.png")
    return data, stem


def template(study_file: str | Path) -> str:
    """The ``page.md`` beside a study's module (pass its ``__file__``): the page's text, with ``{field}``s to
    ``str.format``."""
    return (Path(study_file).parent / "page.md").read_text()
