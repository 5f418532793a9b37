import sys

from . import CONFIGS, config_path
from ...errors import LinearizeError

if len(sys.argv) != 2 or sys.argv[1] in ("-h", "--help"):
    print(f"usage: python -m linearize.recipes.launch {{{','.join(CONFIGS)}}}: the path of an accelerate config")
    sys.exit(0 if len(sys.argv) == 2 else 2)
try:
    print(config_path(sys.argv[1]))
except LinearizeError as e:
    print(f"linearize: error: {e}", file=sys.stderr)
    sys.exit(2)
