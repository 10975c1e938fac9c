"""Command-line programs; scripts/*.py and the console entry points call their main()."""


def device_refused(device: str | None) -> bool:
    """Whether --device names a device this machine lacks; if so, says so in one line on stderr (the
    command then exits with 2). None (the command's default) is never refused."""
    import sys

    from captioner.api import check_device

    try:
        if device is not None:
            check_device(device)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return True
    return False
