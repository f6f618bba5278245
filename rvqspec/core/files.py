"""Reading the JSON files rvqspec takes (configs, trees, corpus indexes): one error line naming the file and the fix."""

import json
from pathlib import Path

from rvqspec.core.errors import RvqspecError


def read_json(path: str | Path, fix: str):
    """The JSON in `path`, or one line naming the file and the fix (damaged JSON, bytes that are not UTF-8, or nesting
    deeper than the parser recurses)."""
    try:
        return json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise RvqspecError(f"{path} is not valid JSON ({type(e).__name__ if isinstance(e, RecursionError) else e}): "
                           f"{fix}") from None
