import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # the corpus modules (so_*.py)
sys.path.insert(0, str(Path(__file__).parents[1] / "serving"))  # serving_support
