#!/usr/bin/env bash
# The units issue 53 still needs (benchmarks/dp_certified_mnist.py), in the order they are wanted. Run it
# once per core, e.g. `nohup nice bash benchmarks/dp_certified_mnist_queue.sh > /tmp/q1.log 2>&1 &` twice on
# two cores: each unit is claimed by the process that runs it (<unit>.running), so two workers share the list,
# a finished unit is skipped, and an interrupted one resumes (its training checkpoint, its CERTIFY progress).
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
unit() { "$PY" benchmarks/dp_certified_mnist.py --threads 1 "$@" || echo "unit failed: $*"; }
V="--split val --n 10000 --seeds 0"
# 53.4, the non-private row with the LeNet: the N 100,000 units, then the validation units that choose the row
# (every test configuration of a row needs one before validation chooses it: envelope())
unit --epsilons none --methods lenet_gaussian --sigmas 0.5 --seeds 0 --n 100000
unit --epsilons none --methods lenet_consistency --sigmas 1.0 --seeds 0 --n 100000
unit --epsilons none --methods lenet_gaussian --sigmas 0.5 $V
# 53.2: levers at epsilon 3 on the validation split (the LeNet, sigma_01 0.75, k = 8)
unit --epsilons 3 --methods lenet_dpcert --sigmas 0.5 $V
unit --epsilons 3 --methods dpcert --sigmas 0.75 $V
unit --epsilons 3 --methods consistency --sigmas 0.75 $V
unit --epsilons 3 --methods dpcert_k8 --sigmas 0.5 $V
unit --epsilons none --methods lenet_consistency --sigmas 1.0 $V
unit --epsilons none --methods gaussian --sigmas 0.5 $V
unit --epsilons none --methods dpcert --sigmas 0.5 $V
# the epsilon 3 row's test configurations that have no validation unit yet (then validation chooses the row)
unit --epsilons 3 --methods gaussian --sigmas 1.0 $V
unit --epsilons 3 --methods consistency --sigmas 1.0 $V
unit --epsilons 3 --methods dpcert --sigmas 1.0 $V
# 53.2: what validation projected to N 100,000 points to (consistency at sigma_01 0.5: 59.8 at r 1.5 against
# dpcert's 56.6; at 0.75: 33.2 at r 2.0), on the test images at N 100,000
unit --epsilons 3 --methods consistency --sigmas 0.5 --seeds 0 --n 100000
unit --epsilons 3 --methods consistency --sigmas 0.75 --seeds 0 --n 100000
unit --epsilons 3 --methods dpcert_k8 --sigmas 0.5 --seeds 0 --n 100000   # k 8 projects +0.8 at r 0.5, +2.2 at r 1.5
# 53.3: the same levers at epsilon 1 on the validation split, and the row's test configurations there
unit --epsilons 1 --methods consistency --sigmas 0.5 $V
unit --epsilons 1 --methods consistency --sigmas 0.75 $V
unit --epsilons 1 --methods dpcert --sigmas 0.5 $V
unit --epsilons 1 --methods consistency --sigmas 1.0 $V
unit --epsilons 1 --methods gaussian --sigmas 0.5 $V
unit --epsilons 1 --methods gaussian --sigmas 1.0 $V
# 53.4: the LeNet at the literature's other sigmas (r 1.0 / 1.5 and r 0.5), each with its validation unit
unit --epsilons none --methods lenet_consistency --sigmas 0.5 --seeds 0 --n 100000
unit --epsilons none --methods lenet_consistency --sigmas 0.5 $V
unit --epsilons none --methods lenet_gaussian --sigmas 0.25 --seeds 0 --n 100000     # r 0.5: Cohen et al.'s sigma there
unit --epsilons none --methods lenet_gaussian --sigmas 0.25 $V
# seeds 1 and 2 of the epsilon 3 levers and of the LeNet configurations
unit --epsilons 3 --methods consistency --sigmas 0.5 --seeds 1 --n 100000
unit --epsilons 3 --methods consistency --sigmas 0.75 --seeds 1 --n 100000
unit --epsilons 3 --methods consistency --sigmas 0.5 --seeds 2 --n 100000
unit --epsilons 3 --methods consistency --sigmas 0.75 --seeds 2 --n 100000
unit --epsilons none --methods lenet_gaussian --sigmas 0.5 --seeds 1 --n 100000
unit --epsilons none --methods lenet_consistency --sigmas 1.0 --seeds 1 --n 100000
unit --epsilons none --methods lenet_gaussian --sigmas 0.5 --seeds 2 --n 100000
unit --epsilons none --methods lenet_consistency --sigmas 1.0 --seeds 2 --n 100000
