import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # conftest_helpers for the engine tests

from conftest_helpers import hf_reference  # noqa: E402,F401
