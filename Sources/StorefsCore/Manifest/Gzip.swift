internal import CZlib

/// gzip streams (zlib, through the CZlib shim): manifests may be gzipped both ways. Each
/// stream owns its zlib state and frees it in `deinit`.
final class GzipDecoder {
    private let stream: OpaquePointer

    init?() {
        guard let s = czlib_inflate_new() else { return nil }
        stream = s
    }

    deinit { czlib_free(stream) }

    enum Step {
        /// Progress: `consumed` input bytes taken, `produced` output bytes written.
        case progress(consumed: Int, produced: Int)
        /// A gzip member ended (its trailer checked) after these counts.
        case memberEnd(consumed: Int, produced: Int)
    }

    /// Decodes what it can of `input` into `output`; a damaged stream throws zlib's reason.
    func decode(_ input: UnsafeRawBufferPointer, into output: UnsafeMutableRawBufferPointer) throws(GzipError) -> Step {
        var consumed = 0
        var produced = 0
        let rc = czlib_inflate(stream, input.baseAddress?.assumingMemoryBound(to: UInt8.self), input.count, &consumed,
                               output.baseAddress?.assumingMemoryBound(to: UInt8.self), output.count, &produced)
        switch rc {
        case Int32(CZLIB_END): return .memberEnd(consumed: consumed, produced: produced)
        case Int32(CZLIB_OK): return .progress(consumed: consumed, produced: produced)
        default: throw GzipError(reason: String(cString: czlib_message(stream)))
        }
    }

    /// Starts the next member of a multi-member file.
    func reset() -> Bool { czlib_inflate_reset(stream) == 0 }
}

final class GzipEncoder {
    private let stream: OpaquePointer

    init?(level: Int32 = 6) {
        guard let s = czlib_deflate_new(level) else { return nil }
        stream = s
    }

    deinit { czlib_free(stream) }

    /// Encodes `input` (all of it, calling `emit` with each piece of output); with `finish`,
    /// ends the stream (trailer included).
    func encode(_ input: UnsafeRawBufferPointer, finish: Bool, emit: (UnsafeRawBufferPointer) throws(ManifestError) -> Void) throws(ManifestError) {
        var out = [UInt8](repeating: 0, count: 64 << 10)
        var at = 0
        while true {
            var consumed = 0
            var produced = 0
            let rest = UnsafeRawBufferPointer(rebasing: input[at...])
            let rc = out.withUnsafeMutableBufferPointer { o in
                czlib_deflate(stream, rest.baseAddress?.assumingMemoryBound(to: UInt8.self), rest.count, &consumed,
                              o.baseAddress, o.count, &produced, finish ? 1 : 0)
            }
            guard rc != Int32(CZLIB_ERROR) else { throw ManifestError("gzip: \(String(cString: czlib_message(stream)))") }
            at += consumed
            if produced > 0 { try out.withBytes { o throws(ManifestError) in try emit(UnsafeRawBufferPointer(rebasing: o[0..<produced])) } }
            if rc == Int32(CZLIB_END) { return }
            if at == input.count && !finish && produced < out.count { return }
        }
    }
}

struct GzipError: Error {
    let reason: String
}
