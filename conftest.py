"""Repository-root conftest: puts the repo on sys.path so `import models`, `from kl import ...` work."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
