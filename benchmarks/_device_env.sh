# Sourced by the device scripts (gpu_final.sh, gpu_diag.sh): $OUT, the carried
# wheels (.whl, .whl2 from fetch_device_wheels.sh) on PYTHONPATH, pytest flags.
OUT="${OUT:-$PWD/gpu-out}"
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl/*.whl .whl2/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
P="-q -s -W ignore::pytest.PytestConfigWarning -W ignore::pytest.PytestUnknownMarkWarning -p no:cacheprovider"
