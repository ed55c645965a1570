#!/usr/bin/env bash
# Source on the lent device machine, from the repo root: installs the carried wheels (.whl, from
# ../shared/device/bundle-wheels.sh plus a setuptools wheel) under /tmp/site and this package in editable mode, so
# the `lazytrain` console script exists for the tests that run it as a subprocess. A carried .whl-extra (peft,
# accelerate, DeepSpeed and its dependencies, moved there so that a run which needs none stays under the carry limit)
# is installed too.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl $(ls .whl-extra/*.whl 2>/dev/null) || return 1
export PYTHONPATH=/tmp/site:$PYTHONPATH PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || return 1
