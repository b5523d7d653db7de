internal import CCrypto
import Foundation

/// The few cryptographic operations storefs needs: RS256 for JWT grants and V4 signed URLs.
public enum Crypto {
    /// RSASSA-PKCS1-v1_5 with SHA-256 under a PEM (PKCS#8 or PKCS#1) private key.
    static func rs256Sign(pem: String, _ data: [UInt8]) throws(StorageError) -> [UInt8] {
        var signature = [UInt8](repeating: 0, count: 1024)
        var length = signature.count
        let rc = pem.utf8CString.withUnsafeBufferPointer { p in
            data.withUnsafeBytes { d in
                signature.withUnsafeMutableBufferPointer { s in
                    ccrypto_rs256_sign(p.baseAddress, p.count - 1, d.baseAddress, d.count, s.baseAddress, &length)
                }
            }
        }
        switch rc {
        case 0: return Array(signature[0..<length])
        case -1: throw StorageError(.invalidArgument, "the service-account private_key is not a valid PEM RSA key")
        default: throw StorageError(.invalidArgument, "RS256 signing failed")
        }
    }

    public static func sha256(_ data: [UInt8]) -> [UInt8] {
        var out = [UInt8](repeating: 0, count: 32)
        data.withUnsafeBytes { d in out.withUnsafeMutableBufferPointer { ccrypto_sha256(d.baseAddress, d.count, $0.baseAddress) } }
        return out
    }

    public static func hex(_ bytes: [UInt8]) -> String {
        let digits = Array("0123456789abcdef".utf8)
        var out: [UInt8] = []
        out.reserveCapacity(bytes.count * 2)
        for b in bytes { out.append(digits[Int(b >> 4)]); out.append(digits[Int(b & 15)]) }
        return String(decoding: out, as: UTF8.self)
    }

    static func base64url(_ bytes: [UInt8]) -> String {
        Data(bytes).base64EncodedString()
            .replacingOccurrences(of: "+", with: "-").replacingOccurrences(of: "/", with: "_")
            .replacingOccurrences(of: "=", with: "")
    }

    /// The claims of a JWT without checking its signature (to read `exp` of an ID token).
    static func unverifiedClaims(_ jwt: String) -> [String: Any]? {
        let parts = jwt.split(separator: ".")
        guard parts.count >= 2 else { return nil }
        var b64 = parts[1].replacingOccurrences(of: "-", with: "+").replacingOccurrences(of: "_", with: "/")
        while b64.count % 4 != 0 { b64 += "=" }
        guard let data = Data(base64Encoded: b64) else { return nil }
        return (try? JSONSerialization.jsonObject(with: data)) as? [String: Any]
    }
}
