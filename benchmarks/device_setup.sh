#!/usr/bin/env bash
# Source on the lent device machine, from the repo root: installs the carried wheels (.whl, from
# ../shared/device/bundle-wheels.sh plus a setuptools wheel) under /tmp/site and this package in editable mode, so
# the `lazytrain` console script exists for the tests that run it as a subprocess. The wheels of the extras
# (.whl-peft: peft and accelerate; .whl-ds: DeepSpeed and its dependencies) are installed when carried: kept apart so
# that a run which needs neither stays under the 64 MiB carry limit.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl $(ls .whl-peft/*.whl .whl-ds/*.whl 2>/dev/null) || return 1
export PYTHONPATH=/tmp/site:$PYTHONPATH PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || return 1
