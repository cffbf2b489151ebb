import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "serving"))  # serving_support
sys.path.insert(0, str(Path(__file__).parents[1] / "operator"))  # ipool_samples
sys.path.insert(0, str(Path(__file__).parent))  # monitoring helpers
