import sys

try:
    from tformer.cli import main
except KeyboardInterrupt:  # Ctrl-C while the imports load: no traceback
    print("tformer: interrupted", file=sys.stderr)
    raise SystemExit(130) from None

if __name__ == "__main__":
    raise SystemExit(main())
