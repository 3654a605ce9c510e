"""What the batch loop's judge of whole calls sees (`batch_policy_domino.judge_call`): for each call of the batch size,
the gain over plain steps it computed, the average it keeps and how many plain-steps-only calls follow. Runs
`examples/generate_ab.py` with the given arguments and prints a line per judged call. docs/benchmarks.md, "A batch
size whose calls lose takes plain steps", quotes it:

    python examples/call_gains.py --prompts mtbench --num-prompts 16 --max-new-tokens 64 --batch-size 4 \\
        --repeats 2 --settings default
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

from hf_domino import batch_policy_domino


def logged(learn):
    def learn_call_gain(record, gain: float) -> None:
        learn(record, gain)
        print(
            f"  call gain {gain:.3f}, average {record.call_gain:.3f}, plain-steps calls next: {record.plain_calls_left}",
            flush=True,
        )

    return learn_call_gain


if __name__ == "__main__":
    batch_policy_domino.learn_call_gain = logged(batch_policy_domino.learn_call_gain)
    sys.argv = ["generate_ab.py", *sys.argv[1:]]
    runpy.run_path(str(Path(__file__).with_name("generate_ab.py")), run_name="__main__")
