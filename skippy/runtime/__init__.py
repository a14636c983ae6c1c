"""Runtimes: the stage boundary (StageLoad, StageRuntime) and the engines behind it."""
