internal import CBlockCache

/// CRC32C for cached blocks (hardware instruction where available) and SHA-256 for cache keys.
enum Checksum {
    static func crc32c(_ bytes: UnsafeRawBufferPointer) -> UInt32 {
        cchecksum_crc32c(0, bytes.baseAddress, bytes.count)
    }

    /// The table-driven software CRC (what CPUs without SSE4.2 use); tests compare the two.
    static func crc32cPortable(_ bytes: UnsafeRawBufferPointer) -> UInt32 {
        cblockcache_crc32c_portable(0, bytes.baseAddress, bytes.count)
    }

    static func sha256(_ bytes: [UInt8]) -> [UInt8] {
        var out = [UInt8](repeating: 0, count: 32)
        bytes.withUnsafeBytes { src in out.withUnsafeMutableBufferPointer { cchecksum_sha256(src.baseAddress, src.count, $0.baseAddress) } }
        return out
    }
}

/// Hole punching for evicted blocks.
enum SparseFile {
    static func punchHole(_ fd: Int32, offset: Int64, length: Int64) -> Bool {
        cblockcache_punch_hole(fd, off_t(offset), off_t(length)) == 0
    }
}
