"""The examples run as written (CI runs them on CPU)."""
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_decoding_example_cached_matches_recomputed():
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "decoding.py"), "--check",
                           "--steps", "12", "--beams", "3"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "check passed" in proc.stdout
    assert "attention_with_kvcache ran on: cpu" in proc.stdout
