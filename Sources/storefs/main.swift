// storefs: see StorefsMain.swift. Kept tiny: top-level code is @MainActor (docs/fuse-notes.md, item 1).
import Glibc
exit(StorefsMain.run(CommandLine.arguments))
