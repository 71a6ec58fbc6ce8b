#!/usr/bin/env bash
# The second test environment: the versions a GPU install of hpcrl[sglang] gets (SGLang 0.5.23's own pins and
# what they cap, .ci/sglang-pins.txt), where the main suite runs newer ones. It builds .venv-sglang (reused when
# it is there: pip then reinstalls only hpcrl), installs torch first and hpcrl with its dev extra under the pins, and
# runs the tests of what SGLang's versions reach: the inference client, the contract with SGLang's request
# classes, the OpenAI routes and the agents' OpenAI client, the chat model and tokenizer (transformers), and weight
# sync (torch). The README's test command runs it after the main suite. Arguments go to pytest.
#
# torch 2.14.1 here is PyPI's build, a CUDA build (with its CUDA libraries, several GB): PyPI publishes no CPU-only
# build of 2.14.1 (that one is on download.pytorch.org, which CI machines cannot reach). It is the same torch
# version SGLang runs, and on a machine without a GPU it runs on the CPU; the script checks that it does.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${HPCRL_SGLANG_VENV:-.venv-sglang}
pins=.ci/sglang-pins.txt
tests=(
    tests/inference/test_client.py tests/inference/test_client_control.py tests/inference/test_client_fakes.py
    tests/inference/test_client_pool.py tests/inference/test_sglang_contract.py
    tests/inference/test_openai_contract.py tests/inference/test_openai_protocol.py tests/inference/test_server_openai.py
    tests/inference/test_server_weights.py tests/inference/test_weight_layout.py
    tests/rollout/test_proxy.py tests/rollout/test_agent_workflow.py
    tests/models/test_chat_model.py tests/models/test_tokenizer.py
    tests/train/test_weight_push.py tests/controller/test_weights.py
)
start=$SECONDS
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
# --no-compile: torch's thousands of modules are compiled when imported, not all of them at install
"$venv/bin/pip" install -q --no-compile -c "$pins" torch==2.14.1
"$venv/bin/pip" install -q -c "$pins" -e '.[dev]'
echo "sglang-env: $venv ready in $((SECONDS - start)) s"
"$venv/bin/python" - "$pins" <<'EOF'
"""Print the versions the tests run, and stop unless they are the pinned ones and torch runs on the CPU."""
import importlib.metadata as md
import sys

import torch
from packaging.requirements import Requirement

pins = [Requirement(line.split("#")[0].strip()) for line in open(sys.argv[1]) if line.split("#")[0].strip()]
wrong = [f"{p.name} {md.version(p.name)} (pinned {p.specifier})" for p in pins if md.version(p.name) not in p.specifier]
if wrong:
    sys.exit(f"sglang-env: installed versions are not the pinned ones: {', '.join(wrong)}")
print("sglang-env: " + ", ".join(f"{p.name} {md.version(p.name)}" for p in pins), f"(Python {sys.version.split()[0]})")
x = torch.arange(6.0).reshape(2, 3)
assert (x @ x.T).tolist() == [[5.0, 14.0], [14.0, 50.0]], "torch computes wrongly on the CPU"
print(f"sglang-env: torch {torch.__version__} (a CUDA {torch.version.cuda} build), CUDA available: "
      f"{torch.cuda.is_available()}, a matmul on the CPU is right")
EOF
"$venv/bin/python" -m pytest "${tests[@]}" "$@"
echo "sglang-env: install and tests took $((SECONDS - start)) s"
