import StorageClient

/// The on-disk format of one cached object generation (`<cache_dir>/v1/<hh>/<sha256>.blk`).
///
/// One file per (endpoint, bucket, object name, generation), named by the SHA-256 of that key,
/// so no object name ever reaches a path (nor the file's contents). Layout, little-endian:
///
///     0    8  magic "STFSBLK\0"
///     8    4  format version (1)
///     12   4  block size
///     16   8  object size
///     24   8  generation
///     32  32  SHA-256 of the key
///     64   4  block count
///     68   4  CRC32C of bytes 0..<68
///     72  56  zero
///     128  8 × block count: per block, CRC32C (u32) and stored length (u32; 0 = absent)
///     data starts at the next multiple of 4096; block i at dataOffset + i × blockSize
///
/// Crash safety without fsync ordering: a block's bytes are written before its index entry,
/// and every block is checked against its CRC32C before it is served. A torn or lost write
/// therefore shows up as a missing or mismatching block, which is fetched again: never as
/// wrong bytes. Any change here must bump `version` (the golden test pins the bytes).
struct CacheFileFormat: Equatable {
    static let magic: [UInt8] = Array("STFSBLK\0".utf8)
    static let version: UInt32 = 1
    static let headerSize = 128
    static let entrySize = 8

    var blockSize: Int
    var objectSize: Int64
    var generation: Int64
    var keyHash: [UInt8]

    var blockCount: Int { objectSize == 0 ? 0 : Int((objectSize + Int64(blockSize) - 1) / Int64(blockSize)) }
    var dataOffset: Int64 {
        let end = Self.headerSize + Self.entrySize * blockCount
        return Int64((end + 4095) / 4096 * 4096)
    }

    func entryOffset(_ block: Int) -> Int64 { Int64(Self.headerSize + Self.entrySize * block) }
    func blockOffset(_ block: Int) -> Int64 { dataOffset + Int64(block) * Int64(blockSize) }

    /// Bytes in block `i` (the last one may be short).
    func blockLength(_ block: Int) -> Int {
        let start = Int64(block) * Int64(blockSize)
        return Int(min(Int64(blockSize), objectSize - start))
    }

    func encodeHeader() -> [UInt8] {
        var b = [UInt8](repeating: 0, count: Self.headerSize)
        b.replaceSubrange(0..<8, with: Self.magic)
        Self.put(&b, 8, UInt64(Self.version), bytes: 4)
        Self.put(&b, 12, UInt64(blockSize), bytes: 4)
        Self.put(&b, 16, UInt64(bitPattern: objectSize), bytes: 8)
        Self.put(&b, 24, UInt64(bitPattern: generation), bytes: 8)
        b.replaceSubrange(32..<64, with: keyHash)
        Self.put(&b, 64, UInt64(blockCount), bytes: 4)
        let crc = b.withUnsafeBytes { Checksum.crc32c(UnsafeRawBufferPointer(rebasing: $0[0..<68])) }
        Self.put(&b, 68, UInt64(crc), bytes: 4)
        return b
    }

    /// Decodes a header; nil for anything that is not a valid version-1 header.
    static func decodeHeader(_ b: [UInt8]) -> CacheFileFormat? {
        guard b.count >= headerSize, Array(b[0..<8]) == magic, get(b, 8, bytes: 4) == UInt64(version) else { return nil }
        let crc = b.withUnsafeBytes { Checksum.crc32c(UnsafeRawBufferPointer(rebasing: $0[0..<68])) }
        guard get(b, 68, bytes: 4) == UInt64(crc) else { return nil }
        let f = CacheFileFormat(blockSize: Int(get(b, 12, bytes: 4)), objectSize: Int64(bitPattern: get(b, 16, bytes: 8)),
                                generation: Int64(bitPattern: get(b, 24, bytes: 8)), keyHash: Array(b[32..<64]))
        // Bounds before any arithmetic on them: a damaged or planted header must not trap.
        guard f.blockSize >= 4096, f.blockSize <= 16 << 20, f.blockSize & (f.blockSize - 1) == 0,
              (0...ObjectMetadata.maxSize).contains(f.objectSize), Int(get(b, 64, bytes: 4)) == f.blockCount else { return nil }
        return f
    }

    struct Entry: Equatable {
        var crc: UInt32
        /// 0 when the block is absent.
        var length: UInt32
        static let absent = Entry(crc: 0, length: 0)
    }

    static func encode(_ e: Entry) -> [UInt8] {
        var b = [UInt8](repeating: 0, count: entrySize)
        put(&b, 0, UInt64(e.crc), bytes: 4)
        put(&b, 4, UInt64(e.length), bytes: 4)
        return b
    }

    /// Consecutive entries, as they lie in the index.
    static func encode(_ entries: [Entry]) -> [UInt8] {
        var b = [UInt8](repeating: 0, count: entrySize * entries.count)
        for (i, e) in entries.enumerated() {
            put(&b, i * entrySize, UInt64(e.crc), bytes: 4)
            put(&b, i * entrySize + 4, UInt64(e.length), bytes: 4)
        }
        return b
    }

    static func decodeEntries(_ b: [UInt8], count: Int) -> [Entry] {
        (0..<count).map { i in
            Entry(crc: UInt32(get(b, i * entrySize, bytes: 4)), length: UInt32(get(b, i * entrySize + 4, bytes: 4)))
        }
    }

    private static func put(_ b: inout [UInt8], _ at: Int, _ v: UInt64, bytes: Int) {
        for i in 0..<bytes { b[at + i] = UInt8(truncatingIfNeeded: v >> (8 * UInt64(i))) }
    }

    private static func get(_ b: [UInt8], _ at: Int, bytes: Int) -> UInt64 {
        var v: UInt64 = 0
        for i in 0..<bytes { v |= UInt64(b[at + i]) << (8 * UInt64(i)) }
        return v
    }
}
