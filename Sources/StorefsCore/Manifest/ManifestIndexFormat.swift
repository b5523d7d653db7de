/// The on-disk index of a manifest (`cache_dir/mf-v1/<sha256>.idx`): the tree of names the
/// mount serves, built once from the manifest and mapped read-only by every mount of it
/// (docs/manifest.md, "The index"). Little-endian, fixed-size records, no pointers:
///
///     header (128 bytes)
///       0    8  magic "STFSMIX\0"
///       8    4  format version (1)
///       12   4  child record size (40)
///       16   8  directories
///       24   8  children (every entry of every directory)
///       32   8  files
///       40   8  blob offset (128)
///       48   8  blob length
///       56   8  directory table offset (8-byte aligned, after the blob)
///       64   8  child table offset (directory table + 16 × directories)
///       72   8  file size (child table + 40 × children)
///       80  32  identity: SHA-256 of what was indexed (the manifest's files, the bucket)
///       112  4  CRC32C of bytes [128, file size)
///       116  4  CRC32C of bytes [0, 116)
///       120  8  zero
///     blob: the entries' names (path components, UTF-8), one after another
///     directory table, 16 bytes each; directory 0 is the bucket's root
///       0    8  first child (index into the child table)
///       8    4  children
///       12   4  parent directory
///     child table, 40 bytes each; a directory's children are consecutive, in byte order of
///     their names (readdir offsets, binary search)
///       0    8  name offset in the blob (bits 0–47), name length (48–55), flags (56–63:
///               1 = directory, 2 = has crc32c)
///       8    8  size, or the directory's number for a directory
///       16   8  generation (0 for a directory)
///       24   8  modification time, seconds (signed)
///       32   4  modification time, nanoseconds
///       36   4  crc32c
///
/// Read back, the index is untrusted: the header's checksums are checked and the whole
/// content's at mount (a damaged index is built again), and every offset is bounds-checked
/// at every use. Any change here must bump `version` (the golden test pins the bytes).
enum ManifestIndexFormat {
    static let magic: [UInt8] = Array("STFSMIX\0".utf8)
    static let version: UInt32 = 1
    static let headerSize = 128
    static let directorySize = 16
    static let childSize = 40
    static let flagDirectory: UInt8 = 1
    static let flagCRC: UInt8 = 2
    /// The directory's name under the cache directory.
    static let versionName = "mf-v1"

    struct Header: Equatable {
        var directories: UInt64
        var children: UInt64
        var files: UInt64
        var blobLength: UInt64
        var identity: [UInt8]
        var contentCRC: UInt32

        var blobOffset: UInt64 { UInt64(ManifestIndexFormat.headerSize) }
        var directoriesOffset: UInt64 { (blobOffset + blobLength + 7) / 8 * 8 }
        var childrenOffset: UInt64 { directoriesOffset + directories * UInt64(ManifestIndexFormat.directorySize) }
        var fileSize: UInt64 { childrenOffset + children * UInt64(ManifestIndexFormat.childSize) }

        func encode() -> [UInt8] {
            var b = [UInt8](repeating: 0, count: ManifestIndexFormat.headerSize)
            b.replaceSubrange(0..<8, with: ManifestIndexFormat.magic)
            put(&b, 8, UInt64(ManifestIndexFormat.version), 4)
            put(&b, 12, UInt64(ManifestIndexFormat.childSize), 4)
            put(&b, 16, directories, 8)
            put(&b, 24, children, 8)
            put(&b, 32, files, 8)
            put(&b, 40, blobOffset, 8)
            put(&b, 48, blobLength, 8)
            put(&b, 56, directoriesOffset, 8)
            put(&b, 64, childrenOffset, 8)
            put(&b, 72, fileSize, 8)
            b.replaceSubrange(80..<112, with: identity)
            put(&b, 112, UInt64(contentCRC), 4)
            let crc = b.withUnsafeBytes { Checksum.crc32c(UnsafeRawBufferPointer(rebasing: $0[0..<116])) }
            put(&b, 116, UInt64(crc), 4)
            return b
        }

        /// A header that is ours and consistent (checksum, version, every offset where it
        /// must be, sizes that do not overflow); nil for anything else.
        static func decode(_ b: UnsafeRawBufferPointer) -> Header? {
            let f = ManifestIndexFormat.self
            guard b.count >= f.headerSize, b[0..<8].elementsEqual(f.magic), get(b, 8, 4) == UInt64(f.version),
                  get(b, 12, 4) == UInt64(f.childSize) else { return nil }
            let crc = Checksum.crc32c(UnsafeRawBufferPointer(rebasing: b[0..<116]))
            guard get(b, 116, 4) == UInt64(crc) else { return nil }
            let h = Header(directories: get(b, 16, 8), children: get(b, 24, 8), files: get(b, 32, 8), blobLength: get(b, 48, 8),
                           identity: Array(b[80..<112]), contentCRC: UInt32(get(b, 112, 4)))
            // Bounds before arithmetic: counts far beyond any manifest are refused, so the
            // products below cannot overflow.
            let limit: UInt64 = 1 << 40
            guard h.directories >= 1, h.directories <= limit, h.children <= limit, h.files <= h.children,
                  h.blobLength <= limit << 8, h.directories <= h.children + 1 else { return nil }
            guard get(b, 40, 8) == h.blobOffset, get(b, 56, 8) == h.directoriesOffset, get(b, 64, 8) == h.childrenOffset,
                  get(b, 72, 8) == h.fileSize else { return nil }
            return h
        }
    }

    static func put(_ b: inout [UInt8], _ at: Int, _ v: UInt64, _ bytes: Int) {
        for i in 0..<bytes { b[at + i] = UInt8(truncatingIfNeeded: v >> (8 * UInt64(i))) }
    }

    static func get(_ b: UnsafeRawBufferPointer, _ at: Int, _ bytes: Int) -> UInt64 {
        var v: UInt64 = 0
        for i in 0..<bytes { v |= UInt64(b[at + i]) << (8 * UInt64(i)) }
        return v
    }

    /// One child record, decoded.
    struct Child: Equatable {
        var nameOffset: UInt64
        var nameLength: Int
        var flags: UInt8
        /// Size of a file; number of a directory.
        var value: UInt64
        var generation: UInt64
        var seconds: Int64
        var nanoseconds: UInt32
        var crc32c: UInt32

        var isDirectory: Bool { flags & ManifestIndexFormat.flagDirectory != 0 }
        var hasCRC: Bool { flags & ManifestIndexFormat.flagCRC != 0 }

        func encode(into p: UnsafeMutableRawPointer) {
            let word = nameOffset & 0xFFFF_FFFF_FFFF | UInt64(nameLength & 0xFF) << 48 | UInt64(flags) << 56
            p.storeBytes(of: word.littleEndian, toByteOffset: 0, as: UInt64.self)
            p.storeBytes(of: value.littleEndian, toByteOffset: 8, as: UInt64.self)
            p.storeBytes(of: generation.littleEndian, toByteOffset: 16, as: UInt64.self)
            p.storeBytes(of: UInt64(bitPattern: seconds).littleEndian, toByteOffset: 24, as: UInt64.self)
            p.storeBytes(of: nanoseconds.littleEndian, toByteOffset: 32, as: UInt32.self)
            p.storeBytes(of: crc32c.littleEndian, toByteOffset: 36, as: UInt32.self)
        }

        static func decode(_ p: UnsafeRawPointer) -> Child {
            let word = UInt64(littleEndian: p.loadUnaligned(fromByteOffset: 0, as: UInt64.self))
            return Child(nameOffset: word & 0xFFFF_FFFF_FFFF, nameLength: Int(word >> 48 & 0xFF), flags: UInt8(word >> 56),
                         value: UInt64(littleEndian: p.loadUnaligned(fromByteOffset: 8, as: UInt64.self)),
                         generation: UInt64(littleEndian: p.loadUnaligned(fromByteOffset: 16, as: UInt64.self)),
                         seconds: Int64(bitPattern: UInt64(littleEndian: p.loadUnaligned(fromByteOffset: 24, as: UInt64.self))),
                         nanoseconds: UInt32(littleEndian: p.loadUnaligned(fromByteOffset: 32, as: UInt32.self)),
                         crc32c: UInt32(littleEndian: p.loadUnaligned(fromByteOffset: 36, as: UInt32.self)))
        }
    }

    /// One directory record, decoded.
    struct Directory: Equatable {
        var firstChild: UInt64
        var children: UInt32
        var parent: UInt32

        func encode(into p: UnsafeMutableRawPointer) {
            p.storeBytes(of: firstChild.littleEndian, toByteOffset: 0, as: UInt64.self)
            p.storeBytes(of: children.littleEndian, toByteOffset: 8, as: UInt32.self)
            p.storeBytes(of: parent.littleEndian, toByteOffset: 12, as: UInt32.self)
        }

        static func decode(_ p: UnsafeRawPointer) -> Directory {
            Directory(firstChild: UInt64(littleEndian: p.loadUnaligned(fromByteOffset: 0, as: UInt64.self)),
                      children: UInt32(littleEndian: p.loadUnaligned(fromByteOffset: 8, as: UInt32.self)),
                      parent: UInt32(littleEndian: p.loadUnaligned(fromByteOffset: 12, as: UInt32.self)))
        }
    }
}
