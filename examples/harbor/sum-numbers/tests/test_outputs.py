"""Checks /app/answer.txt. The expected sum is computed from this copy of the numbers the image ships,
so an agent that edits /app/numbers.txt does not change what is expected."""

import sys
from pathlib import Path

NUMBERS = [6193, 8020, 8379, 1411, 2394, 5718, 3189, 4244, -24, 3181, 1411, 8817, -356, 1141, 2067]


def main() -> int:
    answer = Path("/app/answer.txt")
    if not answer.is_file():
        print("FAIL: /app/answer.txt does not exist")
        return 1
    text = answer.read_text().strip()
    if text != str(sum(NUMBERS)):
        print(f"FAIL: /app/answer.txt holds {text[:40]!r}, expected {sum(NUMBERS)}")
        return 1
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
