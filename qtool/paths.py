"""Where qtool's data files live (kernel declarations, device profiles, model shapes, example jobs)."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO_ROOT / "configs"
