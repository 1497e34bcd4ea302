"""Where the project's shared material lives: `shared/` beside the repository (as CI lays it out)."""

from pathlib import Path

SHARED_DIR = Path(__file__).resolve().parents[1].parent / "shared"
SEEDS_DIR = SHARED_DIR / "seeds"
FIXTURES_DIR = SHARED_DIR / "fixtures"

if not SHARED_DIR.is_dir():
    raise FileNotFoundError(f"{SHARED_DIR} is missing: the tests read seeds and fixtures from shared/ "
                            "beside the repository")
