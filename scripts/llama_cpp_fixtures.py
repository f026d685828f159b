"""Write the GGUF fixtures of tests/llama_cpp/: a tiny random Llama quantized by llama.cpp's own quantizer.

    python scripts/llama_cpp_fixtures.py          # builds llama-cpp-python once (cached), then writes them

The model is tests/gguf_checkpoints.py's random Llama with one layer (rows of 256 and 512, which
the K- and IQ-types need), written as F32 by gguf-py's `GGUFWriter` as llama.cpp's converter lays it out,
then quantized by `llama_model_quantize` (llama.cpp's `llama-quantize`, through llama-cpp-python)
into each of `FTYPES`: llama.cpp chooses every tensor's type as it does for real checkpoints (its
Q4_K_M keeps some matrices in Q6_K, ...). No importance matrix: the types below do not need one.
llama-cpp-python is built from its source distribution once per machine into
`~/.cache/hetserve/llama-cpp/` (a wheel and a venv of its own); the suite reads the committed files
and needs neither, so CI does not build llama.cpp. Run again after changing the model or the list.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "llama_cpp"
CACHE = Path.home() / ".cache" / "hetserve" / "llama-cpp"
VERSION = "0.3.36"
# llama.cpp's file types (its `llama_ftype`) and the type of the (tied) embedding where it is not
# llama.cpp's choice (its `ggml_type`; None: llama.cpp's, Q6_K): together they hold every K- and
# IQ-type we dequantize (Q2_K: Q2_K, Q3_K; Q3_K_M: Q3_K, Q4_K, Q5_K; Q4_K_M: Q4_K, Q6_K; IQ4_NL;
# IQ4_XS), the embedding in the file's own type keeping the files small, Q4_K_M as llama.cpp makes it
FTYPES = {"Q2_K": (10, 10), "Q3_K_M": (12, 11), "Q4_K_M": (15, None), "IQ4_NL": (25, 20), "IQ4_XS": (30, 23)}
LAYERS = 1

_QUANTIZE = """
import sys, llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = int(sys.argv[3])
if len(sys.argv) > 4:
    params.token_embedding_type = int(sys.argv[4])
params.nthread = 2
rc = llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), params)
sys.exit(rc)
"""


def llama_cpp_python() -> Path:
    """The python of a venv holding llama-cpp-python `VERSION`, built from source once."""
    venv = CACHE / "venv"
    python = venv / "bin" / "python"
    if python.exists() and subprocess.run([python, "-c", "import llama_cpp"], capture_output=True).returncode == 0:
        return python
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    wheels = CACHE / "wheels"
    if not list(wheels.glob(f"llama_cpp_python-{VERSION}-*.whl")):
        subprocess.run([python, "-m", "pip", "wheel", "--no-deps", f"llama-cpp-python=={VERSION}", "-w", wheels],
                       check=True)
    subprocess.run([python, "-m", "pip", "install", "--find-links", wheels, f"llama-cpp-python=={VERSION}"],
                   check=True)
    return python


def main() -> int:
    sys.path.insert(0, str(ROOT))
    from tests.gguf_checkpoints import make_gguf

    python = llama_cpp_python()
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        source = make_gguf("llama", "F32", Path(tmp), options={"num_hidden_layers": LAYERS})
        for old in OUT.glob("llama-*.gguf"):
            old.unlink()
        for name, (ftype, embedding) in FTYPES.items():
            target = OUT / f"llama-{name}.gguf"
            extra = [] if embedding is None else [str(embedding)]
            subprocess.run([python, "-c", _QUANTIZE, str(source), str(target), str(ftype), *extra], check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            print(f"{target.relative_to(ROOT)}: {target.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    shutil.which("cmake") or print("llama-cpp-python builds with cmake and a C++ compiler", file=sys.stderr)
    raise SystemExit(main())
