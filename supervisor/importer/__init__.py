"""supervisor/importer/ turns a trained SyncTalk_2D avatar into a model directory the server serves:
`python -m supervisor import-synctalk2d` (command.py) reads the checkpoints without torch (checkpoint.py),
builds the ONNX models with gpu_actor/model_builder.py, and writes the frames and crop boxes (dataset.py).

May import config/ and gpu_actor/model_builder.py; the server's processes never import it.
"""


class ImportFailed(ValueError):
    """The inputs cannot make a model directory; the message names the file and what to change."""
