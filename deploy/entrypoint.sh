#!/bin/sh
# Container entry point: `hetserve serve` bound to all interfaces, so the published port
# reaches it (the CLI's own default, 127.0.0.1, is unreachable from outside a container).
#
# Model: a Hugging Face directory mounted at $HETSERVE_MODEL_DIR (default /models, the
# image's volume) is served when it holds a config.json; otherwise the embedded default
# model shipped in the package; a mounted file the container user cannot read stops it with a
# message naming the file. A `--model` or `--models-dir` among the arguments wins: the
# mounted directory is then not added (`--model` repeats to serve several models, so adding
# it as well would name the same model twice). The mounted model is served as
# $HETSERVE_MODEL_NAME, else as the last part of its config.json's `_name_or_path` (what the
# checkpoint calls itself: `meta-llama/Llama-3.2-1B` -> `Llama-3.2-1B`), else by its directory's
# name: the `id` in /v1/models and the `model` of every answer, not the mount point's `models`.
# Arguments starting with "-" are appended to `hetserve serve`; anything else
# runs as given (`docker run IMAGE hetserve devices`, `docker run -it IMAGE bash`).
set -eu

# The name a checkpoint gives itself, if it is one `--model NAME=DIR` accepts; else nothing.
model_name() {
    python3 -P -c 'import json, re, sys
try:
    n = str(json.load(open(sys.argv[1])).get("_name_or_path") or "").rstrip("/").rsplit("/", 1)[-1]
except (OSError, ValueError, AttributeError):
    n = ""
print(n if re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}", n) else "")' "$1" 2>/dev/null || true
}

if [ "$#" -gt 0 ] && [ "${1#-}" = "$1" ]; then
    exec "$@"
fi

model_dir="${HETSERVE_MODEL_DIR:-/models}"
given=""
for a in "$@"; do
    case "$a" in
        --model|--model=*|--models-dir|--models-dir=*) given=1 ;;
    esac
done
if [ -n "$given" ]; then
    echo "entrypoint: serving the models given on the command line" >&2
elif [ -f "$model_dir/config.json" ]; then
    # Files the container user cannot read (safetensors writes 0600 files) would fail every
    # worker at load with a misleading "No such file or directory"; say so once, plainly.
    for f in "$model_dir"/*; do
        if [ -f "$f" ] && [ ! -r "$f" ]; then
            echo "entrypoint: $f is not readable by uid $(id -u) (the container user): make the model directory world-readable (chmod -R a+rX DIR) or run with --user matching its owner" >&2
            exit 2
        fi
    done
    name="${HETSERVE_MODEL_NAME:-$(model_name "$model_dir/config.json")}"
    echo "entrypoint: serving the model mounted at $model_dir${name:+ as $name}" >&2
    set -- --model "${name:+$name=}$model_dir" "$@"
else
    echo "entrypoint: no config.json in $model_dir, serving the embedded default model" >&2
fi
exec hetserve serve --host 0.0.0.0 --port "${HETSERVE_PORT:-8000}" "$@"
