import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

# The suite runs in two xdist workers on two cores: one intra-op thread each keeps torch from
# oversubscribing the machine (timing never matters in tests; benchmarks set their own threads).
import torch

torch.set_num_threads(1)
