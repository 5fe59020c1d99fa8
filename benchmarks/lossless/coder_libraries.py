"""``python -m benchmarks.lossless.coder_libraries``: the host coder's library, chosen by measurement.

The same symbols through each candidate library's order-0 ANS coder: every section of ``lowrank_h3_rn``'s codec
buffers of the real model's messages (``benchmarks.lossless.measure.messages``, after ``make real-models``) at
``[1024, 1, 576]`` and ``[128, 1, 576]``, unpacked as ``megatron_tah.codecs.core.ans`` unpacks them, each section under a
model of its own counts. Per library: the coded stream's bytes (the libraries' model tables excluded) against the
sections' order-0 bound, and encode + decode time (model set-up included, the best of 3, one thread) in MB/s of codec
buffer. Candidates: PyPI ``constriction`` (what ``megatron_tah.codecs.core.ans`` uses) and PyPI ``torch-ans``
(``pip install torch-ans==0.4.0``; not a dependency: skipped when absent), its model given each count plus one (with
zero counts in its table it did not return from one real section).
"""

from __future__ import annotations

import argparse
import importlib.util
import warnings
from datetime import date
from pathlib import Path

import numpy as np
import torch

from megatron_tah.codecs.core import ans, entropy
from megatron_tah.config import TahConfig

from .coders import SHAPES, best_of
from .measure import fields, messages
from ..common.pages import replace_block
from ..common.runner import host_info

PRESET = "lowrank_h3_rn"


def _constriction(symbols: np.ndarray, alphabet: int):
    import constriction

    def code():
        counts = np.bincount(symbols, minlength=alphabet)
        model = constriction.stream.model.Categorical(counts / counts.sum(), perfect=False)
        coder = constriction.stream.stack.AnsCoder()
        coder.encode_reverse(symbols, model)
        return coder.get_compressed(), counts

    def uncode(coded):
        words, counts = coded
        model = constriction.stream.model.Categorical(counts / counts.sum(), perfect=False)
        return constriction.stream.stack.AnsCoder(words).decode(model, symbols.size)

    return code, uncode, lambda coded: coded[0].nbytes


def _torch_ans(symbols: np.ndarray, alphabet: int):
    from torch_ans.utils import TorchANSInterface

    rows = torch.from_numpy(symbols).view(1, -1)
    indexes = torch.zeros_like(rows)

    def coder(counts):
        c = TorchANSInterface(impl="rans64", freq_precision=16, device="cpu", num_interleaves=4)
        c.init_params(counts[None], torch.tensor([alphabet], dtype=torch.int32), torch.zeros(1, dtype=torch.int32))
        return c

    def code():
        # every symbol counted once more: torch-ans 0.4.0 did not return from encoding lowrank's coefficient
        # scales at [1024, 1, 576] (121 of 256 byte values present) with their own counts, zeros included
        counts = torch.bincount(rows.view(-1), minlength=alphabet).to(torch.int32) + 1
        return coder(counts).encode_with_indexes(rows, indexes), counts

    def uncode(coded):
        data, counts = coded
        return coder(counts).decode_with_indexes(data, indexes).view(-1).numpy()

    return code, uncode, lambda coded: len(coded[0])


LIBRARIES = {"constriction": _constriction, "torch-ans": _torch_ans}


def run() -> list[dict]:
    """One row per direction, shape and library (sums over the cuts)."""
    warnings.filterwarnings("ignore", module="torch_ans")
    found = messages()
    config = TahConfig(**fields(PRESET))
    available = {name: make for name, make in LIBRARIES.items()
                 if importlib.util.find_spec(name.replace("-", "_")) is not None}
    for name in LIBRARIES.keys() - available.keys():
        print(f"{name}: not installed, skipped")
    rows = []
    for direction, codec, index in (("forward", config.forward_codec(), 0), ("backward", config.backward_codec(), 1)):
        for tokens in SHAPES:
            totals = {name: [0, 0.0] for name in available}
            raw = bound = 0.0
            for pair in found.values():
                x = pair[index][:tokens].contiguous()
                buf = codec.encode(x).numpy()
                raw += buf.size
                for start, size, bits, section in entropy._regions(codec, tuple(x.shape), x.dtype):
                    if not (section and bits):
                        continue
                    symbols = ans.unpack(buf[start:start + size], bits)
                    alphabet = 1 << ans.symbol_bits(bits, size)
                    p = np.bincount(symbols, minlength=alphabet) / symbols.size
                    bound += -(p[p > 0] * np.log2(p[p > 0])).sum() * symbols.size / 8
                    for name, make in available.items():
                        code, uncode, nbytes = make(symbols, alphabet)
                        encode_s, coded = best_of(code)
                        decode_s, back = best_of(lambda: uncode(coded))
                        if not np.array_equal(np.asarray(back, dtype=np.int64), symbols):
                            raise RuntimeError(f"{name} did not give the symbols back")
                        totals[name][0] += nbytes(coded)
                        totals[name][1] += encode_s + decode_s
            for name, (coded, seconds) in totals.items():
                rows.append({"direction": direction, "shape": [tokens, 1, int(x.shape[-1])], "library": name,
                             "bound": bound, "coded": coded, "mb_s": raw / seconds / 1e6})
    return rows


def table(rows: list[dict], command: str) -> str:
    head = (f"Measured by `{command}` on {host_info()['cpu']} ({date.today().isoformat()}; one thread, the best of 3, "
            f"sums over the cuts of `{PRESET}`'s buffers): each library's coded bytes over the order-0 bound of the "
            "same symbols (its model tables excluded) and codec-buffer MB/s of encode + decode.")
    lines = [head, "", "| direction | shape | library | coded vs order-0 | encode + decode MB/s |", "|---|---|---|---:|---:|"]
    lines += [f"| {r['direction']} | `{r['shape']}` | {r['library']} | {r['coded'] / r['bound']:.4f} | {r['mb_s']:.1f} |"
              for r in rows]
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--write", type=Path, default=None, help="the page whose coder_libraries block to replace")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    command = "python -m benchmarks.lossless.coder_libraries" + (f" --write {args.write}" if args.write else "")
    block = table(run(), command)
    print(block)
    if args.write:
        args.write.write_text(replace_block(args.write.read_text(), "coder_libraries", block))


if __name__ == "__main__":
    main()
