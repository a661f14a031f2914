"""Fixed prompt sets shared by the demo and the decode benchmarks (same prompts, every run)."""

from __future__ import annotations

INPUT_GROUNDED = "input-grounded"
OPEN_ENDED = "open-ended"

CODE = '''def mean(values):
    total = 0
    for v in values:
        total += v
    return total / len(values)
'''

PROMPTS: list[tuple[str, str, str]] = [
    (
        "code-edit",
        INPUT_GROUNDED,
        "Rename the function `mean` to `average` in this Python code and return the whole "
        "code, unchanged otherwise:\n\n" + CODE,
    ),
    (
        "extraction",
        INPUT_GROUNDED,
        "Copy the following sentence exactly, word for word: The committee will meet on "
        "Tuesday at the main office to review the budget for the next fiscal year and to "
        "approve the hiring plan.",
    ),
    ("chat-story", OPEN_ENDED, "Tell me a short story about a lighthouse keeper."),
    ("chat-explain", OPEN_ENDED, "Explain why the sky is blue in a few sentences."),
]
