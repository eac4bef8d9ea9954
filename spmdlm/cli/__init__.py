"""The command lines: python -m spmdlm.<verb> runs spmdlm/cli/<verb>.py"""
