/// A Jinja expression.
indirect enum JinjaExpr {
    case literal(JinjaValue)
    case name(String)
    case list([JinjaExpr])
    case dict([(JinjaExpr, JinjaExpr)])
    case attribute(JinjaExpr, String)
    case index(JinjaExpr, JinjaExpr)
    case slice(JinjaExpr, JinjaExpr?, JinjaExpr?, JinjaExpr?)
    case call(JinjaExpr, [JinjaExpr], [(String, JinjaExpr)])
    case filter(JinjaExpr, String, [JinjaExpr], [(String, JinjaExpr)])
    case test(JinjaExpr, String, negated: Bool, [JinjaExpr])
    case not(JinjaExpr)
    case negate(JinjaExpr)
    case binary(String, JinjaExpr, JinjaExpr)
    case and(JinjaExpr, JinjaExpr)
    case or(JinjaExpr, JinjaExpr)
    case conditional(JinjaExpr, condition: JinjaExpr, otherwise: JinjaExpr?)
}

/// A Jinja template node.
indirect enum JinjaNode {
    case text(String)
    case output(JinjaExpr)
    case ifChain([(JinjaExpr, [JinjaNode])], otherwise: [JinjaNode])
    case forLoop(targets: [String], iterable: JinjaExpr, filter: JinjaExpr?, body: [JinjaNode], otherwise: [JinjaNode])
    case set(target: String, attribute: String?, JinjaExpr)
    case setBlock(target: String, body: [JinjaNode])
}

/// Parses template segments into nodes, and tag contents into expressions (Jinja's precedence:
/// conditional < or < and < not < comparison < + - < ~ < * / // % < unary < postfix, filters, tests).
struct JinjaParser {
    private var segments: [JinjaSegment]
    private var position = 0

    static func parse(_ source: String) throws -> [JinjaNode] {
        var parser = JinjaParser(segments: try JinjaLexer.segments(source))
        let (nodes, end) = try parser.parseBlock(until: [])
        if let end { throw TokenizerError.chatTemplate("unexpected {% \(end) %}") }
        return nodes
    }

    private init(segments: [JinjaSegment]) { self.segments = segments }

    /// Parses nodes until a statement whose first word is in `terminators`; returns that statement.
    private mutating func parseBlock(until terminators: Set<String>) throws -> ([JinjaNode], String?) {
        var nodes: [JinjaNode] = []
        while position < segments.count {
            let segment = segments[position]
            position += 1
            switch segment {
            case let .text(t): nodes.append(.text(t))
            case let .expression(e): nodes.append(.output(try ExpressionParser.parse(e)))
            case let .statement(source):
                var tokens = try JinjaTokenizer.tokens(source)
                guard case let .name(keyword)? = tokens.first else { throw TokenizerError.chatTemplate("empty statement") }
                if terminators.contains(keyword) { return (nodes, source) }
                tokens.removeFirst()
                nodes.append(try parseStatement(keyword, tokens, source: source))
            }
        }
        if !terminators.isEmpty {
            throw TokenizerError.chatTemplate("missing {% \(terminators.sorted().joined(separator: " / ")) %}")
        }
        return (nodes, nil)
    }

    private mutating func parseStatement(_ keyword: String, _ tokens: [JinjaToken], source: String) throws -> JinjaNode {
        switch keyword {
        case "if":
            var branches: [(JinjaExpr, [JinjaNode])] = []
            var condition = try ExpressionParser.parse(tokens)
            while true {
                let (body, end) = try parseBlock(until: ["elif", "else", "endif"])
                branches.append((condition, body))
                let endTokens = try JinjaTokenizer.tokens(end!)
                if case .name("elif")? = endTokens.first {
                    condition = try ExpressionParser.parse(Array(endTokens.dropFirst()))
                } else if case .name("else")? = endTokens.first {
                    let (otherwise, _) = try parseBlock(until: ["endif"])
                    return .ifChain(branches, otherwise: otherwise)
                } else {
                    return .ifChain(branches, otherwise: [])
                }
            }
        case "for":
            guard let inIndex = tokens.firstIndex(of: .name("in")) else { throw TokenizerError.chatTemplate("for without in: \(source)") }
            let targets = tokens[..<inIndex].compactMap { t -> String? in if case let .name(n) = t { return n }; return nil }
            var rest = Array(tokens[(inIndex + 1)...])
            var filter: JinjaExpr?
            // `for x in items if cond`: the first top-level `if` that is not part of a conditional.
            if let ifIndex = rest.firstIndex(of: .name("if")), !rest[ifIndex...].contains(.name("else")) {
                filter = try ExpressionParser.parse(Array(rest[(ifIndex + 1)...]))
                rest = Array(rest[..<ifIndex])
            }
            let iterable = try ExpressionParser.parse(rest)
            let (body, end) = try parseBlock(until: ["else", "endfor"])
            var otherwise: [JinjaNode] = []
            if case .name("else")? = try JinjaTokenizer.tokens(end!).first { otherwise = try parseBlock(until: ["endfor"]).0 }
            return .forLoop(targets: targets, iterable: iterable, filter: filter, body: body, otherwise: otherwise)
        case "set":
            guard case let .name(target)? = tokens.first else { throw TokenizerError.chatTemplate("bad set: \(source)") }
            var rest = Array(tokens.dropFirst())
            var attribute: String?
            if rest.count >= 2, rest[0] == .op("."), case let .name(a) = rest[1] {
                attribute = a
                rest = Array(rest.dropFirst(2))
            }
            if rest.isEmpty {
                let (body, _) = try parseBlock(until: ["endset"])
                return .setBlock(target: target, body: body)
            }
            guard rest.first == .op("=") else { throw TokenizerError.chatTemplate("bad set: \(source)") }
            return .set(target: target, attribute: attribute, try ExpressionParser.parse(Array(rest.dropFirst())))
        case "generation", "endgeneration":
            return .text("")  // transformers' marker for assistant masks: no output of its own
        default:
            throw TokenizerError.chatTemplate("unsupported statement {% \(keyword) %}")
        }
    }
}

/// Recursive-descent parser for one expression.
struct ExpressionParser {
    private let tokens: [JinjaToken]
    private var i = 0

    static func parse(_ source: String) throws -> JinjaExpr { try parse(try JinjaTokenizer.tokens(source)) }

    static func parse(_ tokens: [JinjaToken]) throws -> JinjaExpr {
        var p = ExpressionParser(tokens: tokens)
        let e = try p.conditional()
        guard p.i == tokens.count else { throw TokenizerError.chatTemplate("unexpected \(tokens[p.i]) in expression") }
        return e
    }

    private init(tokens: [JinjaToken]) { self.tokens = tokens }

    private var peek: JinjaToken? { i < tokens.count ? tokens[i] : nil }
    private mutating func take(_ t: JinjaToken) -> Bool {
        if peek == t { i += 1; return true }
        return false
    }
    private mutating func expect(_ t: JinjaToken) throws {
        guard take(t) else { throw TokenizerError.chatTemplate("expected \(t), found \(peek.map { "\($0)" } ?? "end")") }
    }
    private mutating func name() throws -> String {
        guard case let .name(n)? = peek else { throw TokenizerError.chatTemplate("expected a name") }
        i += 1
        return n
    }

    private mutating func conditional() throws -> JinjaExpr {
        let value = try or()
        guard take(.name("if")) else { return value }
        let condition = try or()
        let otherwise = take(.name("else")) ? try conditional() : nil
        return .conditional(value, condition: condition, otherwise: otherwise)
    }

    private mutating func or() throws -> JinjaExpr {
        var e = try and()
        while take(.name("or")) { e = .or(e, try and()) }
        return e
    }

    private mutating func and() throws -> JinjaExpr {
        var e = try not()
        while take(.name("and")) { e = .and(e, try not()) }
        return e
    }

    private mutating func not() throws -> JinjaExpr {
        if take(.name("not")) { return .not(try not()) }
        return try comparison()
    }

    private mutating func comparison() throws -> JinjaExpr {
        var e = try additive()
        while true {
            if case let .op(op)? = peek, ["==", "!=", "<", ">", "<=", ">="].contains(op) {
                i += 1
                e = .binary(op, e, try additive())
            } else if take(.name("in")) {
                e = .binary("in", e, try additive())
            } else if peek == .name("not"), i + 1 < tokens.count, tokens[i + 1] == .name("in") {
                i += 2
                e = .not(.binary("in", e, try additive()))
            } else {
                return e
            }
        }
    }

    private mutating func additive() throws -> JinjaExpr {
        var e = try concat()
        while case let .op(op)? = peek, op == "+" || op == "-" {
            i += 1
            e = .binary(op, e, try concat())
        }
        return e
    }

    private mutating func concat() throws -> JinjaExpr {
        var e = try multiplicative()
        while take(.op("~")) { e = .binary("~", e, try multiplicative()) }
        return e
    }

    private mutating func multiplicative() throws -> JinjaExpr {
        var e = try unary()
        while case let .op(op)? = peek, ["*", "/", "//", "%"].contains(op) {
            i += 1
            e = .binary(op, e, try unary())
        }
        return e
    }

    private mutating func unary() throws -> JinjaExpr {
        if take(.op("-")) { return .negate(try unary()) }
        if take(.op("+")) { return try unary() }
        return try filtersAndTests(try postfix(try primary()))
    }

    private mutating func primary() throws -> JinjaExpr {
        guard let t = peek else { throw TokenizerError.chatTemplate("expression ends too early") }
        i += 1
        switch t {
        case let .string(s):
            var value = s
            while case let .string(next)? = peek { value += next; i += 1 }  // adjacent literals concatenate
            return .literal(.string(value))
        case let .int(n): return .literal(.int(n))
        case let .double(d): return .literal(.double(d))
        case let .name(n):
            switch n {
            case "true", "True": return .literal(.bool(true))
            case "false", "False": return .literal(.bool(false))
            case "none", "None": return .literal(.none)
            default: return .name(n)
            }
        case .op("("):
            let e = try conditional()
            if take(.op(",")) {  // a tuple: treated as a list
                var items = [e]
                while !take(.op(")")) { items.append(try conditional()); _ = take(.op(",")) }
                return .list(items)
            }
            try expect(.op(")"))
            return e
        case .op("["):
            var items: [JinjaExpr] = []
            while !take(.op("]")) {
                items.append(try conditional())
                if !take(.op(",")) { try expect(.op("]")); break }
            }
            return .list(items)
        case .op("{"):
            var pairs: [(JinjaExpr, JinjaExpr)] = []
            while !take(.op("}")) {
                let key = try conditional()
                try expect(.op(":"))
                pairs.append((key, try conditional()))
                if !take(.op(",")) { try expect(.op("}")); break }
            }
            return .dict(pairs)
        default:
            throw TokenizerError.chatTemplate("unexpected \(t)")
        }
    }

    private mutating func arguments() throws -> ([JinjaExpr], [(String, JinjaExpr)]) {
        var positional: [JinjaExpr] = [], named: [(String, JinjaExpr)] = []
        while !take(.op(")")) {
            if case let .name(n)? = peek, i + 1 < tokens.count, tokens[i + 1] == .op("=") {
                i += 2
                named.append((n, try conditional()))
            } else {
                positional.append(try conditional())
            }
            if !take(.op(",")) { try expect(.op(")")); break }
        }
        return (positional, named)
    }

    private mutating func postfix(_ base: JinjaExpr) throws -> JinjaExpr {
        var e = base
        while true {
            if take(.op(".")) {
                e = .attribute(e, try name())
            } else if take(.op("[")) {
                var parts: [JinjaExpr?] = [nil]
                var isSlice = false
                while !take(.op("]")) {
                    if take(.op(":")) { isSlice = true; parts.append(nil) } else { parts[parts.count - 1] = try conditional() }
                }
                if isSlice {
                    while parts.count < 3 { parts.append(nil) }
                    e = .slice(e, parts[0], parts[1], parts[2])
                } else {
                    guard let index = parts[0] else { throw TokenizerError.chatTemplate("empty subscript") }
                    e = .index(e, index)
                }
            } else if take(.op("(")) {
                let (args, named) = try arguments()
                e = .call(e, args, named)
            } else {
                return e
            }
        }
    }

    private mutating func filtersAndTests(_ base: JinjaExpr) throws -> JinjaExpr {
        var e = base
        while true {
            if take(.op("|")) {
                let filter = try name()
                var args: [JinjaExpr] = [], named: [(String, JinjaExpr)] = []
                if take(.op("(")) { (args, named) = try arguments() }
                e = .filter(e, filter, args, named)
            } else if take(.name("is")) {
                let negated = take(.name("not"))
                let test = try name()
                var args: [JinjaExpr] = []
                if take(.op("(")) {
                    args = try arguments().0
                } else if let t = peek, case .name = t, !["and", "or", "else", "if", "in", "not"].contains(where: { t == .name($0) }) {
                    args = [try primary()]  // `is equalto x`
                } else if let t = peek, case .string = t {
                    args = [try primary()]
                } else if let t = peek, case .int = t {
                    args = [try primary()]
                }
                e = .test(e, test, negated: negated, args)
            } else {
                return e
            }
        }
    }
}
