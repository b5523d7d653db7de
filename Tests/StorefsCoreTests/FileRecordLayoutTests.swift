import StorageClient
import Testing
@testable import StorefsCore

/// What the kernel's inodes cost (docs/architecture.md, "Metadata memory"): a million of them
/// are held after `ls -lR` of a million objects, so every byte here is a megabyte there.
@Suite struct FileRecordLayoutTests {
    @Test func recordsAndNodesStayCompact() {
        #expect(MemoryLayout<FileRecord>.stride <= 48)
        #expect(MemoryLayout<Node.Kind>.size <= 48, "the directory case lives in FileRecord's spare bits")
        #expect(MemoryLayout<Node>.stride <= 72)
        #expect(MemoryLayout<DirectoryListing.Entry>.stride <= 48)
    }

    @Test func viewsRoundTrip() {
        var r = FileRecord(size: 5, generation: 7, modified: Timestamp(seconds: 1_700_000_000, nanoseconds: 123),
                           crc32c: "ezxp3g==", posixMode: 0o755, posixUID: 1234, posixGID: nil, symlink: .targetInContent)
        #expect(r.crc32c == "ezxp3g==" && r.posixMode == 0o755 && r.posixUID == 1234 && r.posixGID == nil)
        #expect(r.modified == Timestamp(seconds: 1_700_000_000, nanoseconds: 123) && r.symlink == .targetInContent)
        r.crc32c = nil
        r.posixMode = nil
        r.symlink = nil
        #expect(r.crc32c == nil && r.posixMode == nil && r.symlink == nil)
        var n = Node(path: "a", kind: .file(r), fetched: now(), lookups: 3)
        #expect(abs(n.fetched - now()) < 1 && n.lookups == 3)
        n.fetched = -.infinity
        #expect(n.fetched == -.infinity)
    }
}
