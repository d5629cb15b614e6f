"""ONNX and OpenVINO exports (fp32, int8) of every tiny family in tests/tiny.py: cosine vs torch and the probe.

    PYTHONPATH=. python benchmarks/embed_families.py [WORKDIR] > rows.txt

Prints a row per family: for onnx fp32, onnx int8, openvino fp32, openvino int8, the min/mean cosine against
the torch encoder on adapt.backend_export.CHECK_TEXTS, the probe's unpadded first-token change on the exported
graph, and the exporter used (or REFUSED and why). results/embed_families.md holds a run's rows.
"""
import warnings, pathlib, shutil, json, sys, logging
warnings.filterwarnings("ignore"); logging.disable(logging.WARNING)
from adapt.arch import facts_for
from adapt.bidirectional import make_bidirectional
from adapt.export import export_encoder
from adapt.backend_export import add_backend
from tests.tiny import tiny_decoder, tiny_tokenizer, TINY_CONFIGS
root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/adapt-bench/families"); shutil.rmtree(root, ignore_errors=True)
tok = tiny_tokenizer()
rows = []
for fam in TINY_CONFIGS:
    m = make_bidirectional(tiny_decoder(fam, vocab_size=len(tok), attn_implementation=facts_for(fam).attn_implementations[0]))
    src = export_encoder(m, tok, root / fam, max_seq_length=48)
    row = [fam]
    for b, q in [("onnx", None), ("onnx", "int8"), ("openvino", None), ("openvino", "int8")]:
        f = root / f"{fam}-{b}-{q}"; shutil.copytree(src, f)
        try:
            r = add_backend(f, b, q)
            row.append(f"{r['parity']['min_cosine']:.6f}/{r['parity']['mean_cosine']:.6f} probe {r['probe']['unpadded']:.2f} ({r['exporter']})")
        except Exception as e:
            row.append(f"REFUSED {type(e).__name__}: {str(e)[:80]}")
        shutil.rmtree(f)
    print(" | ".join(row), flush=True)
