// storefs: see StorefsMain.swift. Kept tiny: top-level code is @MainActor (fuse-swift-notes.md pitfall 3).
import Glibc
exit(StorefsMain.run(CommandLine.arguments))
