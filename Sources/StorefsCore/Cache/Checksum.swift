internal import CBlockCache
internal import CChecksum
import Foundation

/// CRC32C for cached blocks (hardware instruction where available) and SHA-256 for cache keys.
enum Checksum {
    static func crc32c(_ bytes: UnsafeRawBufferPointer) -> UInt32 {
        cchecksum_crc32c(0, bytes.baseAddress, bytes.count)
    }

    /// The table-driven software CRC (what CPUs without SSE4.2 use); tests compare the two.
    static func crc32cPortable(_ bytes: UnsafeRawBufferPointer) -> UInt32 {
        cchecksum_crc32c_portable(0, bytes.baseAddress, bytes.count)
    }

    /// The CRC32C of consecutive blocks, from the blocks' own CRC32Cs (crc32c_combine): every
    /// block `blockLength` long but the last, `lastLength`.
    static func crc32c(combining crcs: [UInt32], blockLength: Int, lastLength: Int) -> UInt32 {
        crcs.withUnsafeBufferPointer { cchecksum_crc32c_combine($0.baseAddress, $0.count, blockLength, lastLength) }
    }

    /// An object's `crc32c` as the APIs give it: base64 of the 4 big-endian bytes.
    static func crc32c(base64 text: String) -> UInt32? {
        guard let data = Data(base64Encoded: text), data.count == 4 else { return nil }
        return data.reduce(UInt32(0)) { $0 << 8 | UInt32($1) }
    }

    static func sha256(_ bytes: [UInt8]) -> [UInt8] {
        var out = [UInt8](repeating: 0, count: 32)
        bytes.withUnsafeBytes { src in out.withUnsafeMutableBufferPointer { cchecksum_sha256(src.baseAddress, src.count, $0.baseAddress) } }
        return out
    }
}

/// Hole punching for evicted blocks, and allocation ahead of direct writes.
enum SparseFile {
    static func punchHole(_ fd: Int32, offset: Int64, length: Int64) -> Bool {
        cblockcache_punch_hole(fd, off_t(offset), off_t(length)) == 0
    }

    /// Allocates the range's disk space (unwritten, the file's size unchanged).
    @discardableResult
    static func allocate(_ fd: Int32, offset: Int64, length: Int64) -> Bool {
        cblockcache_allocate(fd, off_t(offset), off_t(length)) == 0
    }
}
