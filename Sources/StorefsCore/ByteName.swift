/// An object name, or a path made of them, as the bytes it is.
///
/// Swift's `String` equality, hashing and `hasPrefix` follow Unicode canonical equivalence:
/// `café` written with U+00E9 and with `e` + U+0301 are equal strings, and so are `K` and
/// the KELVIN SIGN once normalised. Object names are byte strings (two such names are two
/// objects), so every table keyed by a name or a path — listings, the inode table, the
/// negative cache, flights — uses this type, and every prefix or `/` split on a name works on
/// its UTF-8 bytes (the helpers below). docs/security.md, "Hostile server answers".
public struct ByteName: Hashable, Comparable, Sendable, CustomStringConvertible {
    public let string: String

    public init(_ string: String) { self.string = string }

    public static func == (a: ByteName, b: ByteName) -> Bool { a.string.utf8.elementsEqual(b.string.utf8) }

    public func hash(into hasher: inout Hasher) {
        var s = string
        s.withUTF8 { hasher.combine(bytes: UnsafeRawBufferPointer($0)) }
    }

    /// Byte order: what `ls` shows as the directory's order (stable readdir offsets).
    public static func < (a: ByteName, b: ByteName) -> Bool { a.string.utf8.lexicographicallyPrecedes(b.string.utf8) }

    public var description: String { string }
}

extension String {
    /// Whether the UTF-8 bytes of `prefix` start this string's bytes.
    func hasBytePrefix(_ prefix: String) -> Bool { utf8.starts(with: prefix.utf8) }

    /// Whether the last byte is `/`.
    var endsWithSlash: Bool { utf8.last == UInt8(ascii: "/") }

    /// Whether a `/` byte occurs (a `/` followed by a combining mark is one Character, but two scalars).
    var containsSlash: Bool { utf8.contains(UInt8(ascii: "/")) }

    /// The string after its first `count` bytes (which end at a scalar boundary: a prefix
    /// matched by bytes, or a `/`).
    func droppingBytes(_ count: Int) -> String { String(decoding: utf8.dropFirst(count), as: UTF8.self) }

    /// The string without its last byte (a trailing `/`).
    var droppingLastByte: String { String(decoding: utf8.dropLast(), as: UTF8.self) }

    /// The pieces between `/` bytes, empty ones included (`a//b` → `a`, ``, `b`).
    var slashComponents: [String] {
        utf8.split(separator: UInt8(ascii: "/"), omittingEmptySubsequences: false).map { String(decoding: $0, as: UTF8.self) }
    }
}
