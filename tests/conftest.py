import sys
from pathlib import Path

# Scenario helpers (launcher, models) live next to the tests.
sys.path.insert(0, str(Path(__file__).parent))
