"""`composer train.py yamls/<x>.yaml [key=value ...]`: LLM-Foundry's trainer, with our plugins registered."""

import sys

from llmfoundry.command_utils import train_from_yaml

if __name__ == "__main__":
    train_from_yaml(sys.argv[1], sys.argv[2:])
