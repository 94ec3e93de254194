import os

import torch

# Benchmarks and tests set threads explicitly: oversubscription made fairseq 60x slower here.
torch.set_num_threads(int(os.environ.get("STREAMBEAM_TEST_THREADS", "2")))
