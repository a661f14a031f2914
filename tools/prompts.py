"""Fixed prompt sets shared by the demo and the decode benchmarks (same prompts, every run).

Input-grounded prompts (code edits, extraction, quoting) are where prompt lookup pays; open-ended
chat is where speculation must not hurt. Each entry is `(prompt class, text)`.
"""

from __future__ import annotations

INPUT_GROUNDED = "input-grounded"
OPEN_ENDED = "open-ended"

_CODE = """def load_users(path):
    users = []
    with open(path) as handle:
        for line in handle:
            name, email, age = line.strip().split(",")
            users.append({"name": name, "email": email, "age": int(age)})
    return users


def adults(users):
    return [user for user in users if user["age"] >= 18]
"""

_TEXT = (
    "The Lighthouse Committee met on 4 March. Maria Okafor reported that the east lamp was "
    "repaired for 1,240 euros. Tom Reyes said the stairs need new railings before the summer "
    "season. The committee agreed to open the tower to visitors on weekends from 1 June, "
    "with tickets at 3 euros for adults and free entry for children under twelve."
)

PROMPTS: list[tuple[str, str]] = [
    (
        INPUT_GROUNDED,
        "Rename the variable `users` to `people` everywhere in this code and "
        "return the full code:\n\n" + _CODE,
    ),
    (
        INPUT_GROUNDED,
        "Add a docstring to each function in this code and return the full code:\n\n" + _CODE,
    ),
    (
        INPUT_GROUNDED,
        "Copy the sentence about the stairs and the sentence about tickets "
        "word for word from this text:\n\n" + _TEXT,
    ),
    (
        INPUT_GROUNDED,
        "Extract every person mentioned in this text with what they said, "
        "quoting the text:\n\n" + _TEXT,
    ),
    (OPEN_ENDED, "Write a short story about a robot who learns to paint."),
    (OPEN_ENDED, "What are three tips for staying focused while studying?"),
]
