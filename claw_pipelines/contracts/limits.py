"""Size bounds every wire record is validated against (one place, so docs and errors agree)."""

import re

INT32_MAX = 2**31 - 1
FLOAT32_MAX = 3.4028234663852886e38  # the largest finite float32: log-probs are stored as float32
MAX_SEQUENCE_TOKENS = 1_048_576
MAX_STEPS_PER_REQUEST = 4_096
MAX_UID_CHARS = 256
MAX_LABEL_CHARS = 128
MAX_TEXT_CHARS = 1_048_576
MAX_METADATA_BYTES = 65_536
MAX_METADATA_DEPTH = 16
UID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:@+=\-]*$"
LABEL_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._\-]*$"
_UID = re.compile(UID_PATTERN)


def is_uid(value: str, max_chars: int = MAX_UID_CHARS) -> bool:
    """Whether `value` is a uid: UID_PATTERN, 1 to `max_chars` characters (as the wire models
    check it; for values read outside them: paths, headers)."""
    return 0 < len(value) <= max_chars and _UID.fullmatch(value) is not None
