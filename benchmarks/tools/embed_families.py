"""ONNX and OpenVINO exports (fp32, int8) of every tiny family in tests/tiny.py: cosine vs torch and the probe.

    python -m benchmarks.tools.embed_families [WORKDIR] > rows.txt

Prints a row per family: for onnx fp32, onnx int8, openvino fp32 and openvino int8, the min/mean cosine
against the torch encoder on adapt.export.graphs.CHECK_TEXTS, the probe's unpadded first-token change on
the exported graph, and the exporter used (or REFUSED and why). benchmarks/results/embed_families.md holds a run's rows.
"""
from __future__ import annotations

import argparse
import logging
import shutil
import warnings
from pathlib import Path

from adapt.model.families import preferred_attention
from adapt.export.graphs import add_backend
from adapt.model.bidirectional import make_bidirectional
from adapt.export.dense import export_encoder
from tests.tiny import TINY_CONFIGS, tiny_decoder, tiny_tokenizer

VARIANTS = [("onnx", None), ("onnx", "int8"), ("openvino", None), ("openvino", "int8")]


def family_row(family: str, root: Path, tokenizer) -> list[str]:
    model = make_bidirectional(tiny_decoder(family, vocab_size=len(tokenizer),
                                            attn_implementation=preferred_attention(family)))
    source = export_encoder(model, tokenizer, root / family, max_seq_length=48)
    row = [family]
    for backend, quantize in VARIANTS:
        folder = root / f"{family}-{backend}-{quantize}"
        shutil.copytree(source, folder)
        try:
            r = add_backend(folder, backend, quantize)
            row.append(f"{r['parity']['min_cosine']:.6f}/{r['parity']['mean_cosine']:.6f} "
                       f"probe {r['probe']['unpadded']:.2f} ({r['exporter']})")
        except Exception as e:  # noqa: BLE001 - a refusal is a result of this table
            row.append(f"REFUSED {type(e).__name__}: {str(e)[:80]}")
        shutil.rmtree(folder)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workdir", nargs="?", default="/tmp/adapt-bench/families", help="emptied, then filled")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    root = Path(args.workdir)
    shutil.rmtree(root, ignore_errors=True)
    tokenizer = tiny_tokenizer()
    for family in TINY_CONFIGS:
        print(" | ".join(family_row(family, root, tokenizer)), flush=True)


if __name__ == "__main__":
    main()
