"""Trainer integrations: ``zero_offload.integrations.hf`` (Hugging Face ``Trainer``) and
``zero_offload.integrations.lightning``. Each imports its trainer library only when imported
itself, so that zero_offload needs neither (``pip install zero_offload[hf]`` /
``[lightning]``)."""
