"""fairseq-streambeam: fast batched decoding for fairseq models (`--user-dir` plugin).

Importing registers the task `streambeam_translation`, the GAD drafter (`--arch block_drafter`,
`--criterion block_drafting`) and lets `torch.load` read fairseq
checkpoints (torch >= 2.6 loads with weights_only=True, which rejects argparse.Namespace).
"""

import argparse
import logging

import torch

# fairseq adapter: importing fairseq.tasks (which the task below does) runs text_to_speech's
# logging.basicConfig(INFO) and its "Please install tensorboardX" notice, which decoding never
# needs; a level on that one logger keeps it off this package's commands' stderr.
logging.getLogger("fairseq.tasks.text_to_speech").setLevel(logging.WARNING)

torch.serialization.add_safe_globals([argparse.Namespace])

from . import task  # noqa: E402,F401  (registers the task with fairseq)
from .criterions import block_drafting  # noqa: E402,F401  (registers --criterion block_drafting)
from .generators.stream_beam import StreamBeamGenerator  # noqa: E402
from .models import block_drafter  # noqa: E402,F401  (registers --arch block_drafter)
from .runtime.scheduler import Budget  # noqa: E402
from .task import attach_to_hub  # noqa: E402

__all__ = ["StreamBeamGenerator", "Budget", "attach_to_hub"]
__version__ = "0.1.0"
