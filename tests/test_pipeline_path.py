"""`pipeline(..., assistant_model="<drafter folder>")` in a plain script, as a user runs it (not inside pytest, whose
earlier imports can hide an import-order problem)."""

from __future__ import annotations

import subprocess
import sys

import pytest

PATH_SCRIPT = """
import hf_domino
from transformers import pipeline
from hf_domino.assets import SHIPPED_DRAFTER, load_target

target, tokenizer = load_target("smollm2", device="cpu")
messages = [{"role": "user", "content": "What is 2+2?"}]
expected = pipeline("text-generation", model=target, tokenizer=tokenizer)(messages, max_new_tokens=8, do_sample=False)
generator = pipeline("text-generation", model=target, tokenizer=tokenizer, assistant_model=str(SHIPPED_DRAFTER))
assert type(generator.assistant_model).__name__ == "DominoForSpeculation", type(generator.assistant_model)
assert generator.assistant_model.dtype == target.dtype  # the pipeline casts the assistant to the target's dtype
output = generator(messages, max_new_tokens=8, do_sample=False)
assert output == expected, (output, expected)
assert generator.assistant_model.last_generation_stats is not None
print("ok")
"""


def run_script(code: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, check=False)


@pytest.mark.slow  # in CI, docs/usage.md's pipeline block runs this path (tests/test_docs.py), and the test below
def test_pipeline_with_a_drafter_folder_in_a_plain_script():
    """The shipped folder, on the real offline SmolLM2 target: the pipeline loads it and its output is the target's."""
    result = run_script(PATH_SCRIPT)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


@pytest.mark.parametrize(
    "imports",
    ["import hf_domino\nimport transformers", "import transformers\nimport hf_domino"],
)
def test_pipeline_finds_the_class_whatever_the_import_order(imports):
    """The pipeline looks `architectures` up in the module sys.modules holds *now*; transformers replaces that module
    object the first time model code is imported, so the name must be set after that has happened."""
    code = f"""{imports}
import importlib
from transformers import AutoConfig, AutoModelForCausalLM  # more model code, as a user's script imports
from hf_domino import DominoForSpeculation
from hf_domino.assets import SHIPPED_DRAFTER
namespace = importlib.import_module("transformers")
assert getattr(namespace, "DominoForSpeculation", None) is DominoForSpeculation
config = AutoConfig.from_pretrained(SHIPPED_DRAFTER)  # what pipeline() reads, without trust_remote_code
assert "DominoForSpeculation" in config.architectures, config.architectures
print("ok")
"""
    result = run_script(code, timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
