/// A JSON reader over bytes that builds nothing it is not asked for: the caller walks objects
/// and arrays with callbacks and takes the strings it wants, and everything else is skipped.
/// Listing pages are read this way (docs/architecture.md, "Metadata memory"): a generic tree
/// of a 1,000-item page (`JSONSerialization`) cost 5 ms and tens of times the text in memory.
///
/// Hostile input is expected (docs/security.md): the body is already size-capped, nesting is
/// capped at `maxDepth`, and any malformed byte is an error, never a guess. Manifests in JSON
/// Lines are read with it too (`package`: StorefsCore's ManifestParser), one line at a time.
package struct JSONScanner {
    package enum Scalar: Equatable {
        case string(String)
        /// A number as written (converted by whoever knows what it should be).
        case number(String)
        case bool(Bool)
        case null
    }

    package static let maxDepth = 64

    private let bytes: [UInt8]
    private var i = 0
    private let what: String
    private let subject: String

    /// `what` starts each error message, `subject` names the text in it ("the server's answer").
    package init(_ bytes: [UInt8], what: String, subject: String = "the server's answer") {
        self.bytes = bytes
        self.what = what
        self.subject = subject
    }

    private func fail(_ why: String) -> StorageError {
        StorageError(.invalidResponse, "\(what): \(subject) is not valid JSON (\(why) at byte \(i))")
    }

    private mutating func skipSpace() {
        while i < bytes.count, bytes[i] == 0x20 || bytes[i] == 0x0A || bytes[i] == 0x0D || bytes[i] == 0x09 { i += 1 }
    }

    /// The next non-space byte, not consumed.
    package mutating func peek() throws(StorageError) -> UInt8 {
        skipSpace()
        guard i < bytes.count else { throw fail("unexpected end") }
        return bytes[i]
    }

    private mutating func expect(_ b: UInt8) throws(StorageError) {
        guard try peek() == b else { throw fail("expected '\(Character(UnicodeScalar(b)))'") }
        i += 1
    }

    /// Checks that only white space is left.
    package mutating func finish() throws(StorageError) {
        skipSpace()
        guard i == bytes.count else { throw fail("text after the value") }
    }

    /// Walks an object: `body` is called with each key, and must consume its value.
    package mutating func object(_ body: (inout JSONScanner, String) throws(StorageError) -> Void) throws(StorageError) {
        try expect(UInt8(ascii: "{"))
        if try peek() == UInt8(ascii: "}") {
            i += 1
            return
        }
        while true {
            let key = try string()
            try expect(UInt8(ascii: ":"))
            try body(&self, key)
            let b = try peek()
            i += 1
            if b == UInt8(ascii: "}") { return }
            guard b == UInt8(ascii: ",") else { throw fail("expected ',' or '}'") }
        }
    }

    /// Walks an array: `body` is called once per element, and must consume it.
    package mutating func array(_ body: (inout JSONScanner) throws(StorageError) -> Void) throws(StorageError) {
        try expect(UInt8(ascii: "["))
        if try peek() == UInt8(ascii: "]") {
            i += 1
            return
        }
        while true {
            try body(&self)
            let b = try peek()
            i += 1
            if b == UInt8(ascii: "]") { return }
            guard b == UInt8(ascii: ",") else { throw fail("expected ',' or ']'") }
        }
    }

    /// A string, a number, true, false or null; an object or array here is an error.
    package mutating func scalar() throws(StorageError) -> Scalar {
        switch try peek() {
        case UInt8(ascii: "\""): return .string(try string())
        case UInt8(ascii: "t"): try literal("true"); return .bool(true)
        case UInt8(ascii: "f"): try literal("false"); return .bool(false)
        case UInt8(ascii: "n"): try literal("null"); return .null
        case UInt8(ascii: "-"), UInt8(ascii: "0")...UInt8(ascii: "9"): return .number(try number())
        default: throw fail("expected a string, number, true, false or null")
        }
    }

    /// A string value, or nil for `null`; any other kind of value is an error.
    package mutating func optionalString() throws(StorageError) -> String? {
        switch try scalar() {
        case .string(let s): return s
        case .null: return nil
        default: throw fail("expected a string")
        }
    }

    /// Skips one value of any kind.
    package mutating func skip(depth: Int = 0) throws(StorageError) {
        guard depth < Self.maxDepth else { throw fail("nested deeper than \(Self.maxDepth)") }
        switch try peek() {
        case UInt8(ascii: "{"): try object { (s, _) throws(StorageError) in try s.skip(depth: depth + 1) }
        case UInt8(ascii: "["): try array { (s) throws(StorageError) in try s.skip(depth: depth + 1) }
        default: _ = try scalar()
        }
    }

    private mutating func literal(_ word: StaticString) throws(StorageError) {
        let n = word.utf8CodeUnitCount
        guard bytes.count - i >= n else { throw fail("unexpected end") }
        for k in 0..<n where bytes[i + k] != word.utf8Start[k] { throw fail("bad literal") }
        i += n
    }

    private mutating func number() throws(StorageError) -> String {
        let start = i
        if bytes[i] == UInt8(ascii: "-") { i += 1 }
        let digits = i
        while i < bytes.count, (UInt8(ascii: "0")...UInt8(ascii: "9")).contains(bytes[i]) { i += 1 }
        guard i > digits else { throw fail("bad number") }
        if i < bytes.count, bytes[i] == UInt8(ascii: ".") {
            i += 1
            let f = i
            while i < bytes.count, (UInt8(ascii: "0")...UInt8(ascii: "9")).contains(bytes[i]) { i += 1 }
            guard i > f else { throw fail("bad number") }
        }
        if i < bytes.count, bytes[i] == UInt8(ascii: "e") || bytes[i] == UInt8(ascii: "E") {
            i += 1
            if i < bytes.count, bytes[i] == UInt8(ascii: "+") || bytes[i] == UInt8(ascii: "-") { i += 1 }
            let e = i
            while i < bytes.count, (UInt8(ascii: "0")...UInt8(ascii: "9")).contains(bytes[i]) { i += 1 }
            guard i > e else { throw fail("bad number") }
        }
        return String(decoding: bytes[start..<i], as: UTF8.self)
    }

    /// A string: the fast path copies the bytes between the quotes; escapes are decoded
    /// (`\uXXXX` with surrogate pairs); raw control characters and invalid UTF-8 are errors.
    package mutating func string() throws(StorageError) -> String {
        try expect(UInt8(ascii: "\""))
        let start = i
        while i < bytes.count, bytes[i] != UInt8(ascii: "\""), bytes[i] != UInt8(ascii: "\\"), bytes[i] >= 0x20 { i += 1 }
        guard i < bytes.count else { throw fail("unterminated string") }
        if bytes[i] == UInt8(ascii: "\"") {
            let s = try validated(bytes[start..<i])
            i += 1
            return s
        }
        var out = Array(bytes[start..<i])
        while true {
            guard i < bytes.count else { throw fail("unterminated string") }
            let b = bytes[i]
            if b == UInt8(ascii: "\"") {
                i += 1
                return try validated(out[...])
            }
            guard b >= 0x20 else { throw fail("control character in a string") }
            guard b == UInt8(ascii: "\\") else {
                out.append(b)
                i += 1
                continue
            }
            i += 1
            guard i < bytes.count else { throw fail("unterminated escape") }
            let e = bytes[i]
            i += 1
            switch e {
            case UInt8(ascii: "\""), UInt8(ascii: "\\"), UInt8(ascii: "/"): out.append(e)
            case UInt8(ascii: "b"): out.append(0x08)
            case UInt8(ascii: "f"): out.append(0x0C)
            case UInt8(ascii: "n"): out.append(0x0A)
            case UInt8(ascii: "r"): out.append(0x0D)
            case UInt8(ascii: "t"): out.append(0x09)
            case UInt8(ascii: "u"):
                var scalar = try hex4()
                if (0xD800...0xDBFF).contains(scalar) {
                    guard bytes.count - i >= 6, bytes[i] == UInt8(ascii: "\\"), bytes[i + 1] == UInt8(ascii: "u") else {
                        throw fail("unpaired surrogate")
                    }
                    i += 2
                    let low = try hex4()
                    guard (0xDC00...0xDFFF).contains(low) else { throw fail("unpaired surrogate") }
                    scalar = 0x10000 + ((scalar - 0xD800) << 10) + (low - 0xDC00)
                } else if (0xDC00...0xDFFF).contains(scalar) {
                    throw fail("unpaired surrogate")
                }
                guard let u = UnicodeScalar(scalar) else { throw fail("bad \\u escape") }
                out += Array(String(Character(u)).utf8)
            default: throw fail("bad escape")
            }
        }
    }

    private mutating func hex4() throws(StorageError) -> UInt32 {
        guard bytes.count - i >= 4 else { throw fail("bad \\u escape") }
        var v: UInt32 = 0
        for _ in 0..<4 {
            let c = bytes[i]
            let d: UInt8
            switch c {
            case UInt8(ascii: "0")...UInt8(ascii: "9"): d = c - UInt8(ascii: "0")
            case UInt8(ascii: "a")...UInt8(ascii: "f"): d = c - UInt8(ascii: "a") + 10
            case UInt8(ascii: "A")...UInt8(ascii: "F"): d = c - UInt8(ascii: "A") + 10
            default: throw fail("bad \\u escape")
            }
            v = v << 4 | UInt32(d)
            i += 1
        }
        return v
    }

    private func validated(_ slice: ArraySlice<UInt8>) throws(StorageError) -> String {
        guard let s = String(validating: slice, as: UTF8.self) else { throw fail("invalid UTF-8 in a string") }
        return s
    }
}
